"""`spotfill bench NAME [--quick] [--json]`: measured speed, never asserted in tests.

Each benchmark is a module exposing `run_bench(quick: bool) -> dict` (numbers at full precision)
and `format_table(result: dict) -> str` for people. Register new ones in BENCHES. Options that only
one benchmark takes (BENCH_OPTIONS) are passed to its run_bench as keyword arguments, and are an
error with any other benchmark.
"""
from __future__ import annotations

import argparse
import importlib

from tasks.cli.args import batch_size, positive_float, positive_floats
from tasks.cli.output import print_json
from tasks.core.errors import UserInputError

BENCHES = {
    "aws": "tasks.bench.aws",
    "filling": "tasks.bench.filling",
    "gpu": "tasks.bench.gpu",
    "planner": "tasks.bench.planner",
    "market": "tasks.bench.market",
    "runtime": "tasks.bench.runtime",
}
# option dest -> (flag, the benchmark that takes it, run_bench's keyword)
BENCH_OPTIONS = {"online_rate": ("--online-rate", "filling", "online_rates"),
                 "instance_type": ("--instance-type", "filling", "instance_type"),
                 "bubble_scale": ("--bubble-scale", "filling", "bubble_scale"),
                 "training_batch": ("--training-batch", "filling", "training_batch"),
                 "part": ("--part", "runtime", "part")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print its table (or --json)")
    p.add_argument("name", choices=sorted(BENCHES))
    p.add_argument("--quick", action="store_true", help="a shorter run (CI-sized)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--online-rate", type=positive_floats, metavar="R[,R...]",
                   help="filling only: online arrivals per second (default 20); a comma-separated "
                        "list runs one bench per rate, one after another")
    p.add_argument("--instance-type", metavar="TYPE",
                   help="filling only: the bubble is this type's push + pull time in the profile "
                        "(default p3.2xlarge)")
    p.add_argument("--bubble-scale", type=positive_float, metavar="X",
                   help="filling only: multiply the bubble by X (default 1)")
    p.add_argument("--training-batch", type=batch_size, metavar="N",
                   help="filling only: the training job's batch (default 16 on CPU, where the "
                        "compute phase is shorter than the bubble as on a GPU; 128 on CUDA)")
    p.add_argument("--part", choices=("overhead", "workers", "gpus", "evaluation"),
                   help="runtime only: one part (the overhead cases, throughput against workers, "
                        "scaling inside a multi-GPU instance, or the cost of evaluating during training)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    options = {}
    for dest, (flag, bench, keyword) in BENCH_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if args.name != bench:
            raise UserInputError(f"{flag} applies only to `bench {bench}`, not `bench {args.name}`")
        options[keyword] = value
    module = importlib.import_module(BENCHES[args.name])
    result = module.run_bench(quick=args.quick, **options)  # it checks its options before any slow work
    if args.json:
        print_json(result)
    else:
        print(module.format_table(result))
    return 0
