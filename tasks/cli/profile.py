"""`spotfill profile` and `spotfill validate` (heavy imports inside the handlers only)."""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks.cli import args as cli_args
from tasks.cli.output import print_json, runtime_errors_in_one_line
from tasks.core.errors import UserInputError
from tasks.core.profile import load_profile
from tasks.core.progress import ProgressBar


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure a workload's model parameters on the local provider and fit them")
    _common(p)
    p.add_argument("--force", action="store_true", help="profile again even if a cached profile matches")
    p.set_defaults(handler=runtime_errors_in_one_line(_profile))

    v = sub.add_parser("validate", help="train held-out clusters to a loss target and compare with the prediction")
    _common(v)
    v.add_argument("--profile", type=Path, default=None,
                   help="profile to validate (default: the preset's cached profile, profiled first if missing)")
    v.add_argument("--loss", type=cli_args.positive_float, default=None, help="loss target (default: the preset's)")
    v.add_argument("--parallel", type=cli_args.positive_count, default=None, help="validation runs at once (default: the preset's)")
    v.add_argument("--repeats", type=cli_args.positive_count, default=None,
                   help="runs per configuration, observed = their mean (default: the preset's)")
    v.set_defaults(handler=runtime_errors_in_one_line(_validate))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the quick preset (a few minutes on 2 cores)")
    p.add_argument("--profiles-dir", type=cli_args.output_dir, default=Path("profiles"))
    p.add_argument("--artifacts-dir", type=cli_args.output_dir, default=Path("artifacts"))
    p.add_argument("--workload", default=None, help="a built-in workload or module:function (default: the preset's)")
    p.add_argument("--workload-opt", action="append", default=None, metavar="KEY=VALUE",
                   help="workload option (repeatable; replaces the preset's options)")
    p.add_argument("--iterations", type=cli_args.positive_count, default=None, help="single-type profiling iterations (default: 30)")
    p.add_argument("--cluster-duration", type=cli_args.duration_s, default=None, help="seconds each profiling cluster trains at least")
    p.add_argument("--profile-budget-s", type=cli_args.duration_s, default=None,
                   help="seconds the profiling clusters may train in all, until they share a loss band (default: 300)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _setup(args):
    import dataclasses

    from tasks.profiling.presets import FULL, QUICK, local_provider
    from tasks.runtime.workloads import check_workload, parse_options  # deferred: torch (start-up cost)

    preset = QUICK if args.quick else FULL
    changes = {}
    if args.workload is not None:
        changes.update(workload=args.workload, workload_options={})
    if args.workload_opt is not None:
        changes["workload_options"] = parse_options(args.workload_opt)
    if args.iterations is not None:
        changes["iterations"] = args.iterations
    if args.cluster_duration is not None:
        changes["cluster_duration_s"] = args.cluster_duration
    if args.profile_budget_s is not None:
        changes["cluster_budget_s"] = args.profile_budget_s
    preset = dataclasses.replace(preset, **changes)
    check_workload(preset.workload, preset.workload_options)  # a bad name or option fails here
    provider, emulation = local_provider(preset, args.artifacts_dir.resolve())
    return preset, provider, emulation


def _profile(args) -> int:
    preset, provider, emulation = _setup(args)
    path, summary = _profile_with_progress(provider, emulation, preset, args.profiles_dir,
                                           force=args.force)
    if args.json:
        print_json({"profile": str(path), **summary})
    else:
        print(f"profile: {path}{' (cached)' if summary['cached'] else ''}")
        for name, wall_s in summary.get("wall_s", {}).items():
            print(f"  wall {name:<24} {wall_s:8.1f} s")
        for name, fit in summary.get("fit", {}).items():
            print(f"  fit {name:<12} R^2 {fit['r2']:.3f}  rmse {fit['rmse']:.4g}  ({fit['n_points']} points)")
    return 0


def _validate(args) -> int:
    import time

    from tasks.profiling.measurements import cluster_label
    from tasks.profiling.validate import validate_profile

    started_s = time.monotonic()
    if args.profile is not None:  # the profile is validated as it is: profiling settings would do nothing
        given = [flag for flag, value in (("--iterations", args.iterations), ("--cluster-duration", args.cluster_duration),
                                          ("--profile-budget-s", args.profile_budget_s)) if value is not None]
        if given:
            raise UserInputError(f"{given[0]} sets how to profile, but --profile {args.profile} is validated as it is")
    preset, provider, emulation = _setup(args)
    path = args.profile
    if path is None:
        path, _ = _profile_with_progress(provider, emulation, preset, args.profiles_dir)
    profile = load_profile(path)
    if profile.workload != preset.workload:
        raise UserInputError(f"{path} profiles {profile.workload!r}, the preset trains {preset.workload!r}")
    loss = args.loss if args.loss is not None else preset.loss_target
    repeats = args.repeats or preset.repeats
    with ProgressBar(len(preset.validation_configs) * repeats, "validate") as bar:
        report = validate_profile(
            provider, profile, preset.workload, list(preset.validation_configs), loss,
            workload_options=preset.workload_options, ps_megabits_per_s=emulation["ps_megabits_per_s"],
            parallel=args.parallel or preset.parallel, repeats=repeats, fitted_clusters=list(preset.fit_clusters),
            plot_path=args.artifacts_dir / f"validation-{preset.name}.png",
            on_run=lambda cluster, run: bar.advance(note=f"{cluster_label(cluster)}: {run.observed_iterations} updates, "
                                                          f"{run.observed_time_s:.1f} s"),
        )
    result = {"profile": str(path), **report.model_dump(), "total_wall_s": time.monotonic() - started_s}
    if args.json:
        print_json(result)
        return 0
    print(f"profile {path}, loss target {loss:g}")
    print("\n".join(validation_lines(report)))
    return 0


def validation_lines(report) -> list[str]:
    """The validation report as a table (each cluster with its workers' GPUs) and its summary."""
    from tasks.profiling.measurements import cluster_label

    lines = [f"{'cluster':<34} {'GPUs/worker':>11} {'pred s':>8} {'obs s':>8} {'err':>6} {'pred it':>8} {'obs it':>7} "
             f"{'err':>6} {'blind s':>8} {'err':>6}"]
    for r in report.configs:
        gpus = ",".join(str(r.gpus_per_worker[t]) for t in r.cluster)
        lines.append(f"{cluster_label(r.cluster):<34} {gpus:>11} {r.predicted_time_s:8.1f} {r.observed_time_s:8.1f} "
                     f"{r.time_error:6.1%} {r.predicted_iterations:8.0f} {r.observed_iterations:7.1f} "
                     f"{r.iterations_error:6.1%} {r.baseline_time_s:8.1f} {r.baseline_time_error:6.1%}")
    lines.append(f"median time error {report.median_time_error:.1%} (max {report.max_time_error:.1%}); "
                 f"median iterations error {report.median_iterations_error:.1%}; contention-blind median "
                 f"{report.baseline_median_time_error:.1%} (max {report.baseline_max_time_error:.1%})")
    one, multi = (("-" if e is None else f"{e:.1%}") for e in (report.one_gpu_median_time_error,
                                                               report.multi_gpu_median_time_error))
    lines.append(f"median time error by GPUs per worker: one-GPU clusters {one}, clusters with multi-GPU workers {multi}")
    lines.append(f"speed model alone (observed iterations): median time error {report.median_speed_time_error:.1%}, "
                 f"contention-blind {report.baseline_median_speed_time_error:.1%}")
    if report.form is not None:
        cv = ", ".join(f"{name} {err:.1%}" if err is not None else f"{name} -" for name, err in report.form["cv_time_log_rms"].items())
        lines.append(f"model form {report.form['chosen']} (cross-validation log-time RMS: {cv}); paper's form: median time "
                     f"error {report.paper_median_time_error:.1%} (max {report.paper_max_time_error:.1%})")
    if report.coverage is not None:
        lines.append(f"{report.interval_level:.0%} intervals: {report.coverage:.0%} of runs inside")
    lines.append(f"plot: {report.plot}")
    return lines


def _profile_with_progress(provider, emulation, preset, directory, force=False):
    """profile_workload with a progress bar of its stages (a cached profile finishes at once).
    The preset's job alone: the runtime's default async rule, default quotas, no loss target."""
    from tasks.profiling.workflow import PROFILING_STAGES, ProfilingJob, profile_workload  # deferred: scipy (start-up cost)

    with ProgressBar(len(PROFILING_STAGES), f"profile {preset.name}") as bar:
        return profile_workload(provider, ProfilingJob(preset, emulation, provider.name), directory=directory,
                                force=force, on_stage=lambda name: bar.advance(note=f"{name} done"))
