"""`spotfill catalog build|show`: rebuild the instance catalog from its public sources, or print
the types priced in a region."""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks.cli import args as cli_args
from tasks.core.atomic import atomic_write_json
from tasks.core.catalog import CATALOG, SOURCES, build_catalog
from tasks.core.errors import UserInputError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("catalog", help="the instance catalog (hardware, prices, interruption bands)")
    verbs = p.add_subparsers(dest="verb", required=True)
    b = verbs.add_parser("build", help="rebuild profiles/instance-catalog.json from profiles/sources/")
    b.add_argument("--sources", default=str(SOURCES))
    b.add_argument("--out", type=cli_args.output_file, default=str(CATALOG))
    b.set_defaults(handler=_build)
    s = verbs.add_parser("show", help="print the types priced in a region")
    s.add_argument("--region", type=cli_args.region, default="us-east-1")
    s.set_defaults(handler=_show)


def _build(args: argparse.Namespace) -> int:
    if Path(args.out).resolve().parent == Path(args.sources).resolve():  # the sources' own folder
        raise UserInputError(f"--out {args.out} is inside --sources {args.sources}: the catalog would mix with "
                             "(or replace) the files it is built from")
    catalog = build_catalog(Path(args.sources))
    atomic_write_json(args.out, catalog)
    print(f"wrote {args.out}: {len(catalog['types'])} types")
    return 0


def _show(args: argparse.Namespace) -> int:
    from tasks.providers.base import catalog_instance_types

    types = catalog_instance_types(args.region)
    print(f"{'type':<16}{'gpus':>5} {'gpu':<22}{'MB/s':>8}{'od $/h':>9}{'spot $/h':>9}{'band':>5}")
    for t in types:
        print(f"{t.name:<16}{t.gpus:>5} {t.gpu_model[:21]:<22}{t.network_mbytes_per_s:>8.0f}{t.on_demand_usd_per_h:>9.3f}"
              f"{t.spot_usd_per_h:>9.3f}{'' if t.interruption_band is None else t.interruption_band:>5}")
    return 0
