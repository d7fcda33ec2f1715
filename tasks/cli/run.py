"""`spotfill run`: the main job, the train-with-slo flow, on the embedded `local` provider by
default, in a temporary Prefect server this command starts and stops (tasks/cli/prefect_server.py)
unless PREFECT_API_URL points at a real one."""
from __future__ import annotations

import argparse
import json

from tasks.cli import args as cli_args
from tasks.cli.output import print_json, runtime_errors_in_one_line
from tasks.core import limits
from tasks.core.errors import UserInputError
from tasks.core.profile import format_validation_error
from tasks.core.progress import ProgressBar
from tasks.core.traces import load_trace, trace_path
from tasks.planner.problem import RISK_LEVEL
from tasks.planner.solvers import DEFAULT_SOLVER, solver_names
from tasks.runtime.async_rule import DEFAULT_RULE, RULES
from tasks.runtime.evaluation import parse_target_metric

# The README's main job: a small transformer LM on the two types of the quick profiling preset.
# At least three workers, so that a revocation leaves survivors, from a market with two of each
# type: the plan mixes them. A real Bamboo trace of the p2/p3 family, replayed
# 25x faster against the p3.2xlarge workers: its drops at 212 s (9 -> 2 instances) and 299 s
# (2 -> 0) revoke them about 12 s after launch; the re-plan keeps the g3.8xlarge survivors.
DEMO = {
    "workload": "transformer-lm",
    "workload_options": {"seq_len": 16},
    "candidates": ["p3.2xlarge", "g3.8xlarge"],
    "quotas": {"p3.2xlarge": 2, "g3.8xlarge": 2},
    "min_workers": 3,
    "target_loss": 1.7,
    "deadline_s": 60.0,
    "trace": "bamboo_aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23.csv",
    "time_scale": 25.0,
    "trace_type": "p3.2xlarge",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train to a loss target before a deadline (the main flow)")
    p.add_argument("--workload", default=DEMO["workload"])
    p.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--loss", type=cli_args.positive_float, default=DEMO["target_loss"], help="target loss")
    p.add_argument("--target-metric", type=cli_args.arg_type(parse_target_metric), default=None, metavar="NAME<=X|NAME>=X",
                   help="reach this metric of the workload's evaluate(model) instead of --loss, e.g. 'val_acc>=0.9' "
                        "(profiled, planned and watched on its curve: docs/model.md)")
    p.add_argument("--deadline", type=cli_args.duration_s, default=DEMO["deadline_s"], help="seconds")
    p.add_argument("--types", default=",".join(DEMO["candidates"]), help="candidate instance types")
    p.add_argument("--quota", type=cli_args.counts, default=None,
                   help="TYPE=N,... (types not named: 4 each; with the demo's types and no --quota: "
                        + ",".join(f"{t}={n}" for t, n in DEMO["quotas"].items()) + ")")
    p.add_argument("--min-workers", type=cli_args.positive_count, default=None,
                   help="plan and re-plan at least this many workers, so a revocation leaves survivors "
                        f"(the demo's market: {DEMO['min_workers']}; otherwise the smallest fitted cluster)")
    p.add_argument("--profile", default=None, help="use this profile instead of profiling")
    p.add_argument("--profiling", choices=["quick", "full"], default="quick", help="profiling preset")
    p.add_argument("--profile-budget-s", type=cli_args.duration_s, default=None,
                   help="seconds the profiling clusters may train in all, until they share a loss band and come near the loss target (default: 300)")
    p.add_argument("--async-rule", choices=sorted(RULES), default=DEFAULT_RULE,
                   help=f"how the parameter server applies a stale gradient (default: {DEFAULT_RULE})")
    p.add_argument("--solver", choices=solver_names(), default=DEFAULT_SOLVER)
    p.add_argument("--risk-level", type=cli_args.positive_float, default=RISK_LEVEL,
                   help=f"with --solver risk: probability of meeting the deadline to plan for (default {RISK_LEVEL:g})")
    p.add_argument("--confidence", type=cli_args.finite_float, default=None,
                   help="plan for the upper end of the prediction's interval at this level, in (0, 1)")
    p.add_argument("--provider", choices=["local", "aws"], default="local")
    p.add_argument("--region", type=cli_args.region, default="us-east-1")
    p.add_argument("--trace", default=None, help="preemption trace to replay (local; default the demo's); '' for none")
    p.add_argument("--trace-type", default=None,
                   help="replay the trace against this type's workers only; '' for every worker "
                        f"(the demo's trace and types: {DEMO['trace_type']})")
    p.add_argument("--time-scale", type=cli_args.positive_float, default=DEMO["time_scale"],
                   help="trace seconds per real second")
    p.add_argument("--revoke-at", type=cli_args.nonnegative_duration_s, action="append", default=[],
                   help="also revoke one worker this many seconds after launch (repeatable)")
    p.add_argument("--on-demand-quota", type=cli_args.counts, default={}, metavar="TYPE=N,...",
                   help="allow this many on-demand workers of each type when spot alone would miss the deadline")
    p.add_argument("--spot-probe-s", type=cli_args.duration_s, default=10.0,
                   help="while on-demand workers run, try spot again this often (seconds; default 10)")
    p.add_argument("--capacity", type=type_and_file, action="append", default=[], metavar="TYPE=FILE",
                   help="local: a spot capacity trace for a type, played from the launch at --time-scale (repeatable)")
    p.add_argument("--drought", type=type_and_seconds, action="append", default=[], metavar="TYPE=SECONDS",
                   help="local: no spot capacity of a type for SECONDS from the first revocation (repeatable)")
    p.add_argument("--checkpoint-bucket", type=cli_args.identifier, default=None, metavar="BUCKET",
                   help="aws: the S3 bucket for the run's lease and durable checkpoints (required on aws)")
    p.add_argument("--lease-s", type=cli_args.duration_s, default=None,
                   help="seconds the run trains on with no orchestrator watching (the CLI killed, a laptop "
                        "asleep) before it checkpoints and stops by itself (default 180)")
    p.add_argument("--no-filling", action="store_true", help="do not fill bubbles with inference")
    p.add_argument("--artifacts", type=cli_args.output_dir, default="artifacts")
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")
    p.add_argument("--resume", type=cli_args.identifier, default=None, metavar="RUN_ID",
                   help="take over a live run whose orchestrator is gone (within its lease): watch it to its end "
                        "and report the whole run; its recorded request is used, the other options are ignored")
    p.set_defaults(handler=runtime_errors_in_one_line(run))


def _type_and_value(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.strip():
        raise UserInputError(f"expected TYPE={what}, got {text[:60]!r}")
    return name.strip(), value.strip()


@cli_args.arg_type
def type_and_file(text: str) -> tuple[str, str]:
    return _type_and_value(text, "FILE")


@cli_args.arg_type
def type_and_seconds(text: str) -> tuple[str, float]:
    name, value = _type_and_value(text, "SECONDS")
    return name, limits.duration_s(value)


def by_type(pairs: list[tuple[str, object]], option: str) -> dict:
    """Repeated TYPE=VALUE options as a dict; a type given twice is refused."""
    out: dict = {}
    for name, value in pairs:
        if name in out:
            raise UserInputError(f"{option}: type {name} given twice")
        out[name] = value
    return out


def demo_request(artifacts_dir: str = "artifacts"):
    """The README's main job: a small built-in workload, three local types, one replayed trace."""
    from tasks.pipeline.params import TrainRequest

    return TrainRequest.model_validate({
        "workload": DEMO["workload"], "workload_options": DEMO["workload_options"],
        "slo": {"target_loss": DEMO["target_loss"], "deadline_s": DEMO["deadline_s"]},
        "candidates": {"types": DEMO["candidates"], "quotas": DEMO["quotas"], "min_workers": DEMO["min_workers"]},
        "provider": {"name": "local", "revocations": {"trace": DEMO["trace"], "time_scale": DEMO["time_scale"],
                                                      "trace_type": DEMO["trace_type"]}},
        "artifacts_dir": artifacts_dir,
    })


def market_defaults(args: argparse.Namespace, types: list[str]) -> dict:
    """Quotas, floor and trace type as given, else the demo's where the run is the demo's: its
    types (and, for the floor, its quotas; for the trace type, its trace)."""
    demo_types = types == DEMO["candidates"]
    quotas = args.quota if args.quota is not None else (DEMO["quotas"] if demo_types else {})
    floor = args.min_workers
    if floor is None and demo_types and args.quota is None:
        floor = DEMO["min_workers"]
    trace_type = args.trace_type
    if trace_type is None and demo_types and args.trace in (None, DEMO["trace"]):  # None: the default, the demo's
        trace_type = DEMO["trace_type"]
    return {"quotas": quotas, "min_workers": floor, "trace_type": trace_type or None}


def build_request(args: argparse.Namespace):
    from pydantic import ValidationError

    from tasks.pipeline.params import TrainRequest
    from tasks.runtime.workloads import parse_options  # deferred: torch (start-up cost)

    if args.trace is None:  # the demo's trace on the local provider; AWS revokes on its own
        args.trace = DEMO["trace"] if args.provider == "local" else ""
    types = [t for t in args.types.split(",") if t]
    market = market_defaults(args, types)
    try:
        return TrainRequest.model_validate({
            "workload": args.workload,
            "workload_options": parse_options(args.workload_opt) if args.workload_opt else
            (DEMO["workload_options"] if args.workload == DEMO["workload"] else {}),
            "slo": {"target_loss": args.loss, "deadline_s": args.deadline,
                    "target_metric": None if args.target_metric is None else str(args.target_metric)},
            "candidates": {"types": types, "quotas": market["quotas"], "min_workers": market["min_workers"],
                           "on_demand_quota": args.on_demand_quota, "spot_probe_s": args.spot_probe_s},
            "profile": args.profile, "profiling": args.profiling, "solver": args.solver, "risk_level": args.risk_level,
            "profile_budget_s": args.profile_budget_s, "async_rule": args.async_rule,
            "confidence": args.confidence,
            "provider": {"name": args.provider, "region": args.region,
                         "aws": {"checkpoint_bucket": args.checkpoint_bucket} if args.checkpoint_bucket else {},
                         "revocations": {"trace": args.trace or None, "trace_type": market["trace_type"],
                                         "time_scale": args.time_scale,
                                         "inject_at_s": args.revoke_at},
                         "capacity_traces": by_type(args.capacity, "--capacity"),
                         "droughts_s": by_type(args.drought, "--drought")},
            "filling": {"enabled": not args.no_filling},
            "artifacts_dir": str(args.artifacts),
            **({"lease_s": args.lease_s} if args.lease_s is not None else {}),
        }, context={"local_user": True})  # the local user may run any plug-in (tasks/pipeline/plugin_policy.py)
    except ValidationError as err:
        raise UserInputError(format_validation_error(err, "run parameters")) from None


def check_request(request) -> None:
    """Everything `run` can check before it starts a Prefect server or a process: the workload and
    its options, the profile, the trace, the candidate types (local); the cheap checks first."""
    from tasks.filling.attach import check_device, worker_fill_config
    from tasks.pipeline.setup import resolve_setup  # deferred: boto3, scipy (start-up cost)
    from tasks.profiling.presets import local_nic_mbytes_per_s
    from tasks.providers.local import default_types
    from tasks.runtime.workloads import check_workload  # deferred: torch (start-up cost)

    limits.ps_bind_address()  # each PS listens there: refused now, not by every PS after it started
    setup = resolve_setup(request)  # what the flow resolves again at its start, less the provider
    if request.profile is not None:
        check_first_plan(setup)
    local = request.provider.name == "local"
    if local and request.provider.revocations.trace:
        load_trace(trace_path(request.provider.revocations.trace))
    if local:
        offered = [t.name for t in default_types()[0]]
        unknown = [t for t in request.candidates.types if t not in offered]
        if unknown:
            raise UserInputError(f"unknown instance type {unknown[0]!r}; local offers {', '.join(offered)}")
        local_nic_mbytes_per_s(setup.preset)  # the emulation the run profiles and trains under
    else:
        check_aws_credentials(setup.aws)
    if request.filling.enabled:  # the workers' filler reads $SPOTFILL_FILL_CONFIG over these: refuse a bad one now

        fill = worker_fill_config({"online_rate_per_s": request.filling.online_rate_per_s,
                                   "slo_s": request.filling.online_slo_s})
        if local:
            check_device(fill)
    # builds the model, trains one step, and with a target metric evaluates it once
    check_workload(request.workload, request.workload_options, target_metric=request.slo.metric)


def check_first_plan(setup) -> None:
    """With a profile given, the run's first plan is made here as the flow's plan task makes it,
    so what that task would refuse (a target the curve cannot reach or starts below, quotas of 0,
    a confidence the profile has no spread for) is refused before a server or a process starts.
    The setup has no provider here, so no prices: the budget cap is the flow's to check."""
    from pathlib import Path

    from tasks.pipeline.session import TrainingSession
    from tasks.pipeline.stages import load_request_profile

    session = TrainingSession(setup, load_request_profile(setup.request), run_id="check", run_dir=Path("."))
    if not any(session.quota.values()):
        raise UserInputError("every candidate type's quota is 0: no instance can be provisioned")
    session.first_plan()


def check_aws_credentials(config) -> None:
    """Credentials boto3 can find for the run's AwsConfig (no call to AWS is made)."""
    import boto3

    from tasks.providers.aws import NO_CREDENTIALS, aws_errors  # deferred: boto3 (start-up cost)

    with aws_errors(config.region):
        credentials = boto3.Session(profile_name=config.profile_name, region_name=config.region).get_credentials()
    if credentials is None:
        raise UserInputError(NO_CREDENTIALS)


def prefect_defaults() -> None:
    """Settings for a laptop with no network: a patient ephemeral server, no analytics."""
    import os

    os.environ.setdefault(STARTUP_TIMEOUT_ENV, "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def startup_timeout_from_env() -> float:
    """How long `run` waits for its Prefect server: the variable Prefect reads, checked here so a
    bad value is named rather than left to a float() deep in the start-up."""
    import os

    text = os.environ[STARTUP_TIMEOUT_ENV]
    try:
        return cli_args.duration_s(text)
    except argparse.ArgumentTypeError as err:
        raise UserInputError(f"{STARTUP_TIMEOUT_ENV}={text[:40]!r}: {err}") from None


def check_prefect_api_url() -> None:
    """A Prefect server the user chose (PREFECT_API_URL) must be an http(s) URL: checked here,
    before anything starts, so a malformed one is one line naming the variable, not a traceback
    from Prefect's settings."""
    import os

    text = os.environ.get("PREFECT_API_URL")
    if text:
        try:
            cli_args.endpoint_url(text)
        except argparse.ArgumentTypeError as err:
            raise UserInputError(f"PREFECT_API_URL={text[:80]!r}: {err}") from None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tasks.cli.prefect_server import temporary_server
    from tasks.pipeline.plugin_policy import allow_local_user

    prefect_defaults()
    startup_timeout_s = startup_timeout_from_env()  # the cheap checks first
    check_prefect_api_url()
    if args.resume:
        request = resumed_request(args.resume, Path(args.artifacts))
    else:
        request = build_request(args)
        check_request(request)
    allow_local_user(request.workload)
    with temporary_server(Path(request.artifacts_dir) / "prefect-server.log", startup_timeout_s):
        return _run_flow(request, args)


def resumed_request(run_id: str, artifacts_dir):
    """The request run `run_id` recorded, its artifacts folder made the one the run lives in
    (the run registry knows it from any folder; else --artifacts)."""
    from tasks.pipeline.journal import recorded_request  # deferred: prefect, scipy (start-up cost)
    from tasks.providers.run_registry import artifacts_dir_of

    artifacts = artifacts_dir_of(run_id) or artifacts_dir.resolve()
    request = recorded_request(artifacts / run_id)
    return request.model_copy(update={"artifacts_dir": str(artifacts)})


def _run_flow(request, args: argparse.Namespace) -> int:
    from flows.train_with_slo import run_summary, train_with_slo  # deferred: boto3, prefect, scipy (start-up cost)
    from tasks.pipeline import stages

    bar = ProgressBar(100, "training")

    def show(session, obs) -> None:
        metric = request.slo.metric
        if obs.loss is None:
            note = "starting"
        else:
            note = f"loss {obs.loss:.3f}" if metric is None else f"{metric.name} {metric.on_curve(obs.loss):.3f}"
        bar.advance(int(100 * max(obs.loss_fraction, obs.time_fraction)) - bar.done, f"{note} ${obs.spent_usd:.4f}")

    stages.PROGRESS_LISTENERS.append(show)
    try:
        summary = run_summary(train_with_slo(request, resume_run_id=args.resume, return_state=True))
    finally:
        bar.close()
        stages.PROGRESS_LISTENERS.remove(show)
    if args.json:
        print_json(json.loads(json.dumps(summary, default=str)))
    else:
        print(summary["verdict"])
        print(f"report: {summary['report_dir']}/report.md  timeline: {summary['timeline_png']}")
    return 0 if summary["met"] else 1
