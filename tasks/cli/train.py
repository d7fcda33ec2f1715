"""`spotfill train`: run asynchronous PS training on the local provider until a step budget, a
target loss or a time limit; optionally with revocations replayed from a real spot trace."""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks.cli import args as cli_args
from tasks.cli.args import counts, duration_s, positive_float, positive_int
from tasks.cli.output import print_json, runtime_errors_in_one_line
from tasks.core.errors import UserInputError
from tasks.core.folder_lock import FolderLock
from tasks.core.limits import check_mbps, env_limit
from tasks.core.progress import ProgressBar
from tasks.core.traces import load_trace
from tasks.core.command_line import arg_type
from tasks.runtime.async_rule import DEFAULT_RULE, RULES
from tasks.runtime.evaluation import DEFAULT_EVAL_EVERY_UPDATES, parse_target_metric

# Local workers are processes on this machine: more than this is a typo that would swamp it.
DEFAULT_MAX_LOCAL_WORKERS = 16
TRACE_TIME_SCALE = 1000.0  # --trace-time-scale's default: trace seconds per real second
NOTICE_S = 5.0  # --notice-s's default


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on the local provider (an emulated spot cloud)")
    p.add_argument("--workload", required=True, help="resnet20..resnet110[-cifar100], transformer-lm, or module:function")
    p.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workers", type=counts, required=True, help="TYPE=N,... spot workers to launch")
    p.add_argument("--batch-size", type=cli_args.batch_size, required=True,
                   help="per GPU: a type with g GPUs trains g replicas and pushes g x this per iteration")
    p.add_argument("--max-updates", type=positive_int, default=None, help="stop after this many updates")
    p.add_argument("--target-loss", type=positive_float, default=None, help="stop at this smoothed loss")
    p.add_argument("--target-metric", type=arg_type(parse_target_metric), default=None, metavar="NAME<=X|NAME>=X",
                   help="judge the trained model on a metric its workload's evaluate(model) reports (docs/plugins.md)")
    p.add_argument("--eval-every-updates", type=positive_int, default=DEFAULT_EVAL_EVERY_UPDATES,
                   help="the PS runs the workload's evaluate(model), if it has one, every N updates; with "
                        "--target-metric it stops once the target is met (docs/plugins.md)")
    p.add_argument("--timeout-s", type=duration_s, default=600.0, help="stop after this long")
    p.add_argument("--ps-mbps", type=cli_args.mbps, default=None, help="emulated PS bandwidth cap (each shard's)")
    p.add_argument("--num-ps", type=positive_int, default=1, help="PS shards the parameters are split across")
    p.add_argument("--bandwidth-scale", type=positive_float, default=None,
                   help="shape each worker's traffic to its type's network bandwidth times this")
    p.add_argument("--reference-compute-s", type=duration_s, default=None,
                   help="emulated compute time per iteration of a relative-speed-1 type")
    p.add_argument("--checkpoint-every-s", type=duration_s, default=30.0)
    p.add_argument("--async-rule", choices=sorted(RULES), default=DEFAULT_RULE,
                   help=f"how the PS applies a stale gradient (default: {DEFAULT_RULE}; docs/runtime.md)")
    p.add_argument("--trace", type=Path, default=None, help="replay revocations from a Bamboo/Parcae trace")
    p.add_argument("--trace-time-scale", type=positive_float, default=None,
                   help=f"with --trace: trace seconds per real second (default {TRACE_TIME_SCALE:g})")
    p.add_argument("--notice-s", type=duration_s, default=None,
                   help=f"with --trace: revocation notice period (default {NOTICE_S:g} s)")
    p.add_argument("--artifacts", type=cli_args.output_dir, default=None,
                   help="run folders go here (default: the repository's artifacts/)")
    p.add_argument("--run-id", type=cli_args.identifier, default=None, help="default: train-<time>")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=runtime_errors_in_one_line(_train))


def max_local_workers() -> int:
    return env_limit("SPOTFILL_MAX_LOCAL_WORKERS", DEFAULT_MAX_LOCAL_WORKERS)


def check_not_finished(run_id: str, latest: dict, max_updates: int | None, target_loss: float | None) -> None:
    """A run resumed by its id past its own stop would train one update more and stop again:
    say instead that it is finished, and how to train it on."""
    updates, loss = latest["updates_total"], latest["smoothed_loss"]
    if max_updates is not None and updates >= max_updates:
        raise UserInputError(f"run {run_id} is finished: its newest checkpoint has {updates} updates, "
                             f"--max-updates is {max_updates}; raise it to train on, or give another --run-id")
    if target_loss is not None and loss is not None and loss <= target_loss:
        raise UserInputError(f"run {run_id} is finished: its newest checkpoint's smoothed loss {loss:.4g} is at "
                             f"--target-loss {target_loss:g}; lower it to train on, or give another --run-id")


def _train(args: argparse.Namespace) -> int:
    import time

    from tasks.providers.local import LocalProvider
    from tasks.runtime.workloads import check_workload, parse_options  # deferred: torch (start-up cost)

    # Every input is checked before the first process starts.
    n_workers = sum(args.workers.values())
    if not n_workers:
        raise UserInputError("--workers launches no worker")
    limit = max_local_workers()
    if n_workers + args.num_ps > limit:
        raise UserInputError(f"--workers and --num-ps start {n_workers + args.num_ps} local processes, above the "
                             f"limit of {limit} (set SPOTFILL_MAX_LOCAL_WORKERS to raise it)")
    provider = LocalProvider(**({"artifacts_dir": args.artifacts} if args.artifacts else {}),
                             bandwidth_scale=args.bandwidth_scale, reference_compute_s=args.reference_compute_s)
    unknown = sorted(set(args.workers) - {t.name for t in provider.list_types()})
    if unknown:
        raise UserInputError(f"unknown instance type {unknown[0]!r}; local offers {', '.join(provider.types)}")
    if args.bandwidth_scale is not None:  # each worker's link is its type's NIC times the scale
        for name in args.workers:
            check_mbps(f"{name}'s link (its NIC times --bandwidth-scale {args.bandwidth_scale:g})",
                       provider.nic_mbps(name))
    options = parse_options(args.workload_opt)
    if args.trace:
        load_trace(args.trace)
    else:
        given = [flag for flag, value in (("--trace-time-scale", args.trace_time_scale), ("--notice-s", args.notice_s))
                 if value is not None]
        if given:
            raise UserInputError(f"{given[0]} sets how a trace is replayed, but no --trace is given")
    if args.target_metric and args.num_ps > 1:
        raise UserInputError("--target-metric judges the final checkpoint of one parameter server: use --num-ps 1")
    workload = check_workload(args.workload, options, target_metric=args.target_metric)  # last: builds, trains one step
    run_id = args.run_id or time.strftime("train-%Y%m%dT%H%M%S")
    with FolderLock(provider.run_dir(run_id), f"run {run_id}"):  # one command per run
        return _train_owned(args, provider, run_id, options, workload)


def _train_owned(args: argparse.Namespace, provider, run_id: str, options: dict, workload) -> int:
    """Resume or start the run and train it; the caller owns the run's folder. `workload`: the
    checked plug-in (its evaluate judges the result on a target metric)."""
    import sys
    import time

    from tasks.runtime import checkpoint, driver  # deferred: torch (start-up cost)

    # What an earlier command on this run left running (it was killed outright: its processes
    # outlive it for a moment) stops now, writing its checkpoint, before this one resumes from it.
    provider.cleanup(run_id)
    # A run id used before resumes from its checkpoints: one that cannot be read is an error now,
    # not a PS that dies at start-up (nor a silent fresh start).
    latest = checkpoint.load_latest(provider.run_dir(run_id) / "checkpoints", quarantine=False)
    if latest is not None:
        check_not_finished(run_id, latest, args.max_updates, args.target_loss)
    started_s = time.monotonic()
    run = driver.start_run(provider, run_id, args.workload, workload_options=options,
                           ps_mbps=args.ps_mbps, checkpoint_every_s=args.checkpoint_every_s, num_ps=args.num_ps,
                           max_updates=args.max_updates, target_loss=args.target_loss,
                           async_rule=args.async_rule, eval_every_updates=args.eval_every_updates,
                           target_metric=str(args.target_metric) if args.target_metric else None)
    try:
        for instance_type, n in args.workers.items():
            driver.add_workers(run, instance_type, n, args.batch_size * provider.types[instance_type].gpus)
        if args.trace:
            provider.replay_trace(run_id, args.trace, args.trace_time_scale or TRACE_TIME_SCALE,
                                  NOTICE_S if args.notice_s is None else args.notice_s)
        bar = ProgressBar(args.max_updates or 1, f"train {run_id}")
        deadline_s = started_s + args.timeout_s
        workers = [i.instance_id for i in provider.describe(run_id) if i.role == "worker"]
        ended = {}  # why this command stopped the run, when the PS had not stopped by itself

        def done(progress) -> bool:
            bar.advance(max(0, progress.updates_total - bar.done), f"loss {progress.smoothed_loss or float('nan'):.3f}")
            failure = driver.ps_failure(run)
            if failure:
                ended["why"], ended["error"] = "ps_failed", failure
            elif time.monotonic() >= deadline_s:
                ended["why"] = "timeout"
            elif not any(i.role == "worker" for i in provider.describe(run_id)):
                ended["why"] = "workers_gone"  # crashed or revoked: nobody is left to train
            return bool(ended)

        driver.wait_for(run, done, timeout_s=args.timeout_s + 60)
        bar.close()
        final = driver.stop_run(run)  # by the STOP file, unless the PS has stopped by itself
        # asked once the PS is gone: it may have stopped as failed while wait_for saw something
        # else first (its workers, sent away by a PS that was failing on a full disk)
        failure = ended.get("error") or driver.ps_failure(run)
        if failure:
            ended["why"], ended["error"] = "ps_failed", failure
    finally:
        provider.cleanup(run_id)
    # the PS's own reason (its workers may have left because of it), else why this command stopped it
    stopped = ("ps_failed" if "error" in ended
               else final.stopped if final.stopped not in (None, "stop_file") else ended.get("why", final.stopped))
    result = {
        "run_id": run_id, "run_dir": str(run.run_dir), "stopped": stopped,
        "updates": final.updates_total, "samples": final.samples_total, "smoothed_loss": final.smoothed_loss,
        "elapsed_s": time.monotonic() - started_s, "resumes": final.resumes,
        "workers": {str(w): {"instance_type": s.instance_type, "gpus": s.gpus, "updates": s.updates, "samples": s.samples,
                             "max_staleness": s.max_staleness, "left": s.left} for w, s in final.workers.items()},
    }
    if args.target_metric:
        metrics = final_metrics(args.workload, options, workload.evaluate, run.run_dir)
        result["metrics"] = metrics
        result["target_metric"] = {"target": str(args.target_metric),
                                   "met": args.target_metric.met(metrics[args.target_metric.name])}
    if args.json:
        print_json(result)
    else:
        loss = "n/a" if final.smoothed_loss is None else f"{final.smoothed_loss:.4f}"
        print(f"run {run_id}: {result['updates']} updates, {result['samples']} samples, smoothed loss {loss}, "
              f"stopped by {result['stopped']}, {result['elapsed_s']:.1f} s")
        print(f"telemetry: {run.run_dir}/telemetry.jsonl")
        if args.target_metric:
            t, value = args.target_metric, result["metrics"][args.target_metric.name]
            print(f"target metric {t}: {t.name} = {value:.4g} on the trained model, "
                  f"{'met' if result['target_metric']['met'] else 'not met'}")
    if stopped == "diverged":
        sys.stderr.write(f"spotfill: the loss diverged (NaN or infinite after {final.updates_total} updates); "
                         "lower the learning rate or check the workload\n")
        return 1
    if stopped == "ps_failed":
        sys.stderr.write(f"spotfill: the parameter server failed after {final.updates_total} updates; "
                         f"{ended['error']}\n")
        return 1
    if stopped == "workers_gone":
        sys.stderr.write(f"spotfill: every worker exited after {final.updates_total} updates; "
                         f"{driver.last_log_line(run.run_dir, workers[-1])}\n")
        return 1
    return 0


def final_metrics(spec: str, options: dict, evaluate, run_dir: Path) -> dict[str, float]:
    """The workload's metrics of the model the run trained: its PS's newest checkpoint loaded into
    a model built as the PS built it."""
    from tasks.runtime import checkpoint, flat  # deferred: torch (start-up cost)
    from tasks.runtime.evaluation import evaluate_model
    from tasks.runtime.workloads import build_workload

    state = checkpoint.load_latest(run_dir / "checkpoints", quarantine=False)
    if state is None:
        raise UserInputError(f"the run left no checkpoint in {run_dir}/checkpoints to evaluate")
    model = build_workload(spec, options).model
    flat.bind(model, with_grads=False).state.copy_(state["params"])
    return evaluate_model(spec, evaluate, model)
