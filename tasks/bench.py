"""`spotfill bench NAME [--quick] [--json]`: measured speed, never asserted in tests.

Each benchmark is a module exposing `run_bench(quick: bool) -> dict` (numbers at full precision)
and `format_table(result: dict) -> str` for people. Register new ones in BENCHES.
"""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "aws": "tasks.providers.aws_bench",
    "filling": "tasks.filling.bench",
    "planner": "tasks.planner.bench",
    "market": "tasks.market.bench",
    "runtime": "tasks.runtime.bench",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its table (or --json)")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("--quick", action="store_true", help="a shorter run (CI-sized)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from tasks.cli import print_json

    module = importlib.import_module(BENCHES[args.name])
    result = module.run_bench(quick=args.quick)
    if args.json:
        print_json(result)
    else:
        print(module.format_table(result))
    return 0
