"""`spotfill simulate`: replay the spot market against every policy and compare what each
delivers: SLO attainment, cost and time distributions over many replays, a table and a PNG."""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks.cli import args as cli_args
from tasks.cli.output import print_json
from tasks.core.errors import UserInputError
from tasks.core.limits import file_stem
from tasks.core.profile import load_profile
from tasks.core.traces import family_of, load_traces
from tasks.planner.problem import RISK_LEVEL

FULL_REPLAYS = 200
QUICK_REPLAYS = 20
MAX_BAND_STRESS = 1e5  # a typo's guard: the traces calibrate about 600; 1e9 kept a quick replay going past 40 s


def band_stress(text: str) -> float:
    value = cli_args.positive_float(text)
    if value > MAX_BAND_STRESS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_BAND_STRESS:g}, got {text}")
    return value


def capacity_by_type(profile, items: list[str]) -> dict[str, list]:
    """`[TYPE=]FILE` items -> {type: [CapacityTrace, ...]}; a file without a type stands for every
    profile type of its family, as revocation traces do."""
    from tasks.core.capacity import load_capacity

    out: dict[str, list] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if sep and name in profile.type_names:
            record, types = load_capacity(path), [name]
        else:
            record = load_capacity(item)
            types = [t for t in profile.type_names if record.family is not None and family_of(t) == record.family]
            if not types:
                raise UserInputError(f"capacity record {item} names no family of the profile's types "
                                     f"({', '.join(profile.type_names)}): pass it as TYPE={item}")
        for t in types:
            out.setdefault(t, []).append(record)
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="replay real spot revocations and prices against every policy")
    p.add_argument("profile")
    p.add_argument("--loss", required=True, type=cli_args.finite_float, help="target loss")
    p.add_argument("--deadline", required=True, type=cli_args.duration_s, help="seconds")
    p.add_argument("--replays", type=cli_args.positive_count, default=None, help=f"replays per policy (default {FULL_REPLAYS}, "
                                                              f"--quick {QUICK_REPLAYS})")
    p.add_argument("--level", type=cli_args.positive_float, default=RISK_LEVEL,
                   help="the risk-aware planner's target probability of meeting the deadline")
    p.add_argument("--traces", nargs="+", default=None, help="trace files (default: profiles/traces/*.csv)")
    p.add_argument("--band", type=cli_args.counts, default={},
                   help="TYPE=B,...: interruption band 0..4 for types the catalog has none for")
    p.add_argument("--band-stress", type=band_stress, default=None,
                   help=f"multiply band hazards by this, at most {MAX_BAND_STRESS:g} (default: calibrated on the traces)")
    p.add_argument("--synthetic", action="store_true",
                   help="revoke every type by a Poisson process at its hazard (trace rate or band) "
                        "instead of replaying trace windows")
    p.add_argument("--quota", type=cli_args.counts, default={}, help="TYPE=N,... (overrides the profile)")
    p.add_argument("--on-demand-quota", type=cli_args.counts, default=None,
                   help="TYPE=N,...: on-demand workers the greedy, uniform-progress and deadline-safe policies may "
                        "use (default: the profile's on_demand_quota, else as many as each type's spot quota)")
    p.add_argument("--capacity", nargs="+", default=[], metavar="[TYPE=]FILE",
                   help="spot capacity records (CSV seconds,available, Bamboo, or JSON gap_seconds/data): for TYPE, "
                        "or for every type of the family its file name starts with; several zones of one type add up")
    p.add_argument("--drought", type=cli_args.time_window_s, default=None, metavar="START,END",
                   help="a synthetic market: no spot capacity of any type from START to END seconds of training")
    p.add_argument("--overhead", type=cli_args.nonnegative_duration_s, default=120.0,
                   help="seconds a new instance takes to start and join (T_ohd)")
    p.add_argument("--region", type=cli_args.region, default="us-east-1", help="region of the bands and the price history")
    p.add_argument("--seed", type=cli_args.seed, default=0)
    p.add_argument("--out-dir", type=cli_args.output_dir, default="artifacts", help="where the PNG goes")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_REPLAYS} replays per policy")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from tasks.market.report import format_table, write_plot
    from tasks.market.study import Study, run_study

    replays = args.replays if args.replays is not None else (QUICK_REPLAYS if args.quick else FULL_REPLAYS)
    if not 0 < args.level < 1:
        raise UserInputError(f"--level must be a probability in (0, 1), got {args.level}")
    profile = load_profile(args.profile)
    traces = load_traces(args.traces)
    if args.traces:  # traces the user names must stand for some type of the profile
        families = {family_of(t) for t in profile.type_names}
        for t in traces:
            if t.family not in families:
                raise UserInputError(f"trace {t.name} is of family {t.family}, which no type of the profile "
                                     f"has ({', '.join(profile.type_names)})")
    if args.drought is not None and args.capacity:
        raise UserInputError("--drought is a synthetic market of its own: give it or --capacity, not both")
    study = Study(profile=profile, loss_target=args.loss, deadline_s=args.deadline, replays=replays,
                  level=args.level, traces=traces, bands=args.band, band_stress=args.band_stress,
                  quota=args.quota, overhead_s=args.overhead, region=args.region, seed=args.seed,
                  synthetic=args.synthetic, on_demand_quota=args.on_demand_quota,
                  capacity=capacity_by_type(profile, args.capacity), drought_s=args.drought)
    result = run_study(study)
    result["plot"] = str(write_plot(result, Path(args.out_dir) / f"simulate-{file_stem(profile.workload)}-{args.deadline:g}s.png"))
    if args.json:
        print_json(result)
    else:
        print(format_table(result))
    return 0
