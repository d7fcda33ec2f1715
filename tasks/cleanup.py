"""`spotfill cleanup`: terminate everything a run started, by hand (runs also clean up after
themselves, at the end, on failure and on cancellation).

    spotfill cleanup --run-id ID [--provider aws|local] [--region R] [--config FILE]
                     [--endpoint-url URL] [--artifacts DIR] [--wait] [--json]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks import cli_args, run_registry


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cleanup", help="terminate every instance a run started")
    p.add_argument("--run-id", required=True, type=cli_args.identifier, help="the run whose instances to terminate")
    p.add_argument("--provider", choices=["aws", "local"], default=None,
                   help="default: local if a local run has this id (any folder), else aws")
    p.add_argument("--region", type=cli_args.region, default=None,
                   help="AWS region (default: the config's, else us-east-1)")
    p.add_argument("--config", type=Path, default=None, help="AWS provider config (JSON, fields of AwsConfig)")
    p.add_argument("--endpoint-url", type=cli_args.endpoint_url, default=None, help="another EC2 endpoint (moto)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="the local provider's run folders (default: where the run was started)")
    p.add_argument("--wait", action="store_true", help="wait until terminated, then delete the run's security group")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=_run)


def _aws_config(args: argparse.Namespace) -> dict:
    from tasks.errors import UserInputError

    from tasks.inputs import read_json

    data: dict = {}
    if args.config is not None:
        data = read_json(args.config, "AWS config")
        if not isinstance(data, dict):
            raise UserInputError(f"AWS config {args.config} is not a JSON object")
    if args.region:
        data["region"] = args.region
    if args.endpoint_url:
        data["endpoint_url"] = args.endpoint_url
    return data


def _local_artifacts(run_id: str, given: Path | None) -> Path:
    """The artifacts folder that holds local run `run_id`; an unknown run is a UserInputError."""
    from tasks.errors import UserInputError
    from tasks.providers.local import TABLE

    candidates = [given] if given is not None else [run_registry.artifacts_dir_of(run_id), Path("artifacts")]
    for folder in filter(None, candidates):
        if (folder / run_id / TABLE).is_file():
            return folder
    where = given if given is not None else "the run registry or ./artifacts"
    raise UserInputError(f"no local run {run_id!r} found in {where}")


def _run(args: argparse.Namespace) -> int:
    from tasks.cli import print_json

    run_id = args.run_id
    provider_name = args.provider or ("local" if run_registry.artifacts_dir_of(run_id) else "aws")
    if provider_name == "local":
        from tasks.providers.local import LocalProvider

        artifacts = _local_artifacts(run_id, args.artifacts)
        terminated, where = LocalProvider(artifacts_dir=artifacts).cleanup(run_id), str(artifacts)
    else:
        from tasks.providers.aws import AwsProvider, load_aws_config

        provider = AwsProvider(load_aws_config(_aws_config(args)))
        terminated, where = provider.cleanup(run_id, wait=args.wait), provider.config.region
    if args.json:
        print_json({"provider": provider_name, "run_id": run_id, "where": where, "terminated": terminated})
    else:
        print(f"terminated {terminated} instance(s) of run {run_id} ({provider_name}, {where})")
    return 0
