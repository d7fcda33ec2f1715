"""Real spot prices per type from DescribeSpotPriceHistory (profiles/sources/, 2022-05-31).

Each replay draws one availability zone per type and pays that zone's mean Linux price over the
day (the archive holds one or two samples per zone, so prices are constant within a ~1 h run);
types with no history in the region pay the profile's spot price.
"""
from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

from tasks.core.catalog import SOURCES
from tasks.core.errors import UserInputError, shown
from tasks.core.limits import positive_float

PRICE_HISTORY = SOURCES / "spot-prices-gpu-2022-05-31.tsv"
# The archive names zones by AZ id (use1-az2); these prefixes are the region's.
REGION_AZ_PREFIX = {"us-east-1": "use1-", "us-east-2": "use2-", "us-west-1": "usw1-", "us-west-2": "usw2-",
                    "eu-west-1": "euw1-", "eu-central-1": "euc1-"}


def zone_prices_usd_per_h(region: str, path: Path = PRICE_HISTORY) -> dict[str, np.ndarray]:
    """{type: mean price of each zone of the region that has history}."""
    prefix = REGION_AZ_PREFIX.get(region)
    if prefix is None or not path.exists():
        return {}
    samples: dict[tuple[str, str], list[float]] = defaultdict(list)
    with path.open() as f:
        for line, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
            if len(row) == 5 and row[2] == "Linux/UNIX" and row[0].startswith(prefix):
                try:
                    samples[(row[1], row[0])].append(positive_float(row[3]))
                except UserInputError as err:
                    raise UserInputError(f"{shown(path)}:{line}: price {err}") from None
    out: dict[str, list[float]] = defaultdict(list)
    for (itype, _), prices in sorted(samples.items()):
        out[itype].append(float(np.mean(prices)))
    return {k: np.array(v) for k, v in out.items()}
