"""`spotfill predict` and `spotfill plan` (docs/cli.md)."""
from __future__ import annotations

import argparse

from tasks.cli import args as cli_args
from tasks.cli.output import print_json
from tasks.core.atomic import atomic_write_json
from tasks.core.errors import UserInputError
from tasks.core.intervals import DEFAULT_LEVEL, check_level, time_interval_s
from tasks.core.model import Model
from tasks.core.profile import load_profile
from tasks.planner.solvers import DEFAULT_SOLVER, solver_names


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict", help="predict time and cost of a given cluster")
    p.add_argument("profile")
    p.add_argument("--cluster", required=True, type=cli_args.counts,
                   help="TYPE=N,TYPE=N (TYPE:on-demand=N for on-demand workers of a type given an on-demand quota)")
    p.add_argument("--on-demand-quota", type=cli_args.counts, default={},
                   help="TYPE=N,... on-demand workers allowed per type (overrides the profile's on_demand_quota)")
    p.add_argument("--loss", required=True, type=cli_args.finite_float, help="target loss")
    p.add_argument("--bandwidth-margin", type=cli_args.nonnegative_float, default=0.0,
                   help="discount network bandwidths by this fraction (e.g. 0.03)")
    p.add_argument("--level", type=cli_args.finite_float, default=None,
                   help="level of the two-sided time interval, in (0, 1) (default 0.9; profiles with a measured error spread)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=predict)

    p = sub.add_parser("plan", help="the cheapest cluster that reaches the loss before the deadline")
    p.add_argument("profile")
    p.add_argument("--loss", required=True, type=cli_args.finite_float, help="target loss")
    p.add_argument("--deadline", required=True, type=cli_args.duration_s, help="seconds")
    # No solver that plans against revocation hazards: plan has no source of them.
    p.add_argument("--solver", choices=solver_names(uses_hazards=False), default=DEFAULT_SOLVER)
    p.add_argument("--existing", type=cli_args.counts, default={}, help="TYPE=N,... already running")
    p.add_argument("--quota", type=cli_args.counts, default={}, help="TYPE=N,... (overrides the profile)")
    p.add_argument("--on-demand-quota", type=cli_args.counts, default={},
                   help="TYPE=N,... also plan up to N on-demand workers of TYPE, named TYPE:on-demand "
                        "(overrides the profile's on_demand_quota)")
    p.add_argument("--overhead", type=cli_args.nonnegative_duration_s, default=0.0,
                   help="seconds taken off the deadline for starting new instances (T_ohd)")
    p.add_argument("--current-loss", type=cli_args.finite_float, default=None,
                   help="re-plan mid-training from this loss")
    p.add_argument("--bandwidth-margin", type=cli_args.nonnegative_float, default=0.0,
                   help="discount network bandwidths by this fraction (e.g. 0.03)")
    p.add_argument("--regions", default=None,
                   help="R1,R2 or all: plan over offers (TYPE@REGION) at catalog prices, with every "
                        "catalog type sharing a GPU model with a measured one (estimated)")
    p.add_argument("--confidence", type=cli_args.finite_float, default=None,
                   help="meet the deadline at the upper end of the prediction's interval at this level, in (0, 1)")
    p.add_argument("--min-workers", type=cli_args.positive_count, default=None,
                   help="plan at least this many workers (default: the smallest cluster the profile's loss "
                        "curve was fitted on, or 1)")
    p.add_argument("--out", type=cli_args.output_file, default=None, help="also write the plan as JSON to this file (atomically)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=plan)


def require_finite(values: dict, source: str) -> None:
    """A prediction with an infinite or NaN number comes from profile numbers too large to compute
    with (a param_mb of 1e308, say): say so, never print it as an answer."""
    import math

    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise UserInputError(f"{source}: its numbers give {name} = {value}; check the magnitudes of its fields")


def predict(args: argparse.Namespace) -> int:
    from tasks.planner.on_demand import require_allowed, with_on_demand
    from tasks.planner.problem import require_training

    if args.level is not None:
        check_level(args.level, "--level")
    profile = with_on_demand(load_profile(args.profile), args.on_demand_quota)
    if args.level is not None and profile.uncertainty is None:
        raise UserInputError(f"--level {args.level:g}: {args.profile} has no uncertainty.time_log_sd (the error spread "
                             "`spotfill profile` measures), so it gives no interval")
    if not args.cluster or sum(args.cluster.values()) == 0:
        raise UserInputError("--cluster names no instance (expected TYPE=N with N > 0)")
    for name in args.cluster:
        require_allowed(profile, name)
    profile.loss.require_reachable(args.loss)
    if args.bandwidth_margin >= 1:
        raise UserInputError(f"--bandwidth-margin must be below 1, got {args.bandwidth_margin}")
    model = Model.from_profile(profile, args.bandwidth_margin)
    r = {k: float(v[0]) for k, v in model.evaluate(model.counts_vector(args.cluster), args.loss).items()}
    out = {
        "workers": sum(args.cluster.values()), "iterations": r["iterations"],  # exact, not the model's float sum
        "expected_iteration_time_s": r["iteration_time_s"], "speed": r["speed"], "wa_batch": r["wa_batch"],
        "cc": r["cc"], "predicted_time_s": r["time_s"], "predicted_cost_usd": r["cost_usd"],
    }
    require_finite(out, args.profile)
    require_training(out["iterations"], args.loss, args.cluster)
    fitted = profile.fitted_workers
    if fitted is not None:  # outside the sizes the loss curve was fitted on, the n-shape is extrapolated
        out["fitted_workers"] = list(fitted)
        out["extrapolated"] = not fitted[0] <= out["workers"] <= fitted[1]
    if profile.uncertainty is not None:  # a profile without a measured spread gives no interval
        level = DEFAULT_LEVEL if args.level is None else args.level
        low_s, high_s = time_interval_s(profile, level, r["time_s"])
        out["interval"] = {"level": level, "time_s": [low_s, high_s],
                           "cost_usd": [low_s / 3600 * r["usd_per_h"], high_s / 3600 * r["usd_per_h"]]}
        require_finite({"interval's upper time": high_s}, args.profile)
    if args.json:
        print_json(out)
        return 0
    cluster = ", ".join(f"{n} x {t}" for t, n in args.cluster.items() if n)
    print(f"cluster          {cluster} ({out['workers']} workers)")
    print(f"iterations       {out['iterations']:.0f} to loss {args.loss}")
    print(f"iteration time   {out['expected_iteration_time_s']:.4f} s (cluster), speed {out['speed']:.1f} samples/s")
    print(f"WA batch / CC    {out['wa_batch']:.1f} / {out['cc']:.4f}")
    print(f"predicted time   {out['predicted_time_s']:.1f} s ({out['predicted_time_s'] / 3600:.2f} h)")
    print(f"predicted cost   ${out['predicted_cost_usd']:.4f} at ${r['usd_per_h']:.4f}/h")
    if out.get("extrapolated"):
        print(f"extrapolated     the loss curve was fitted on {fitted[0]} to {fitted[1]} workers")
    if "interval" in out:
        (low_s, high_s), (low_usd, high_usd) = out["interval"]["time_s"], out["interval"]["cost_usd"]
        print(f"{out['interval']['level']:.0%} interval     {low_s:.1f} - {high_s:.1f} s, ${low_usd:.4f} - ${high_usd:.4f}")
    return 0


def plan(args: argparse.Namespace) -> int:
    from tasks.planner import PlanRequest, solve
    from tasks.planner.offers import parse_regions

    if args.out and args.out.exists() and args.out.samefile(args.profile):
        raise UserInputError(f"--out {args.out} is the profile this plan reads: it would be replaced by the plan")
    request = PlanRequest(
        profile=load_profile(args.profile), loss_target=args.loss, deadline_s=args.deadline,
        existing=args.existing, quota=args.quota, on_demand_quota=args.on_demand_quota, overhead_s=args.overhead,
        current_loss=args.current_loss, bandwidth_margin=args.bandwidth_margin, solver=args.solver,
        regions=() if args.regions is None else parse_regions(args.regions),
        confidence=args.confidence, min_workers=args.min_workers,
    )
    result = solve(request)
    require_finite({"predicted time": result.predicted_time_s, "predicted cost": result.predicted_cost_usd},
                   args.profile)
    if args.out:
        atomic_write_json(args.out, result.to_json())
    if args.json:
        print_json(result.to_json())
        return 0
    print(format_plan(request, result))
    return 0


def format_plan(request, result) -> str:
    """The plan as a table people read: one row per type (an on-demand worker's type says so),
    then the prediction."""
    from tasks.planner.on_demand import split_counts

    width = max([16] + [len(name) + 2 for name in result.plan])
    rows = [f"{'type':<{width}}{'count':>6}{'existing':>10}{'$/h each':>10}{'$/h':>9}"]
    for name, n in sorted(result.plan.items()):
        offer = (result.offers or {}).get(name)
        price = result.unit_usd_per_h[name]
        note = f"  estimated from {offer['estimated_from']}" if offer and offer["estimated"] else ""
        rows.append(f"{name:<{width}}{n:>6}{request.existing.get(name, 0):>10}{price:>10.4f}{n * price:>9.4f}{note}")
    rows.append(f"{'total':<{width}}{sum(result.plan.values()):>6}{sum(request.existing.values()):>10}{'':>10}{result.usd_per_h:>9.4f}")
    rows += [
        "",
        f"predicted time   {result.predicted_time_s:.1f} s of {request.deadline_s:g} s"
        + (f" (minus {request.overhead_s:g} s overhead)" if request.overhead_s else ""),
        f"predicted cost   ${result.predicted_cost_usd:.4f}",
        f"iterations       {result.iterations:.0f}   WA batch {result.wa_batch:.1f}   CC {result.cc:.4f}",
        f"solver           {result.solver} ({result.status}), {result.solve_seconds * 1000:.1f} ms, "
        f"{result.evaluated} clusters scored",
    ]
    if result.min_workers > 1:
        rows.append(f"min workers      {result.min_workers}" + ("" if request.min_workers else
                                                                " (the smallest cluster the loss curve was fitted on)"))
    if result.on_demand_allowed:
        split = {market: sum(counts.values()) for market, counts in split_counts(result.plan).items()}
        rows.append(f"markets          {split['spot']} spot, {split['on-demand']} on-demand (never revoked)")
    if result.confidence is not None:
        c = result.confidence
        rows.append(f"confidence       {c['level']:.0%}: upper end {c['upper_time_s']:.1f} s; "
                    f"${c['extra_cost_usd']:.4f} more than the plan for the central prediction (${c['central_cost_usd']:.4f})")
    return "\n".join(rows)
