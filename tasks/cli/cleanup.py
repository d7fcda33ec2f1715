"""`spotfill cleanup`: terminate everything a run started, by hand (runs also clean up after
themselves, at the end, on failure and on cancellation).

    spotfill cleanup --run-id ID [--provider aws|local] [--region R] [--config FILE]
                     [--endpoint-url URL] [--artifacts DIR] [--wait] [--missing-ok] [--json]

A run id nothing knows (no local run table; on AWS no instance or security group with its tag) is
most likely a typo, so it is exit 2, unless --missing-ok asks for an idempotent clean-up (scripts
that clean up whether or not the run got as far as launching).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tasks.cli import args as cli_args
from tasks.cli.output import print_json
from tasks.core.errors import UserInputError
from tasks.core.inputs import read_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cleanup", help="terminate every instance a run started")
    p.add_argument("--run-id", required=True, type=cli_args.identifier, help="the run whose instances to terminate")
    p.add_argument("--provider", choices=["aws", "local"], default=None,
                   help="default: local if a local run has this id (any folder) or --artifacts is given, else aws")
    p.add_argument("--region", type=cli_args.region, default=None,
                   help="AWS region (default: the config's, else us-east-1)")
    p.add_argument("--config", type=Path, default=None, help="AWS provider config (JSON, fields of AwsConfig)")
    p.add_argument("--endpoint-url", type=cli_args.endpoint_url, default=None, help="another EC2 endpoint (moto)")
    p.add_argument("--artifacts", type=Path, default=None,
                   help="the local provider's run folders (default: where the run was started)")
    p.add_argument("--wait", action="store_true", help="wait until terminated, then delete the run's security group")
    p.add_argument("--missing-ok", action="store_true",
                   help="an unknown run id is not an error: terminate nothing, exit 0")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(handler=_run)


def _aws_config(args: argparse.Namespace) -> dict:
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


def _local_artifacts(run_id: str, given: Path | None) -> Path | None:
    """The artifacts folder that holds local run `run_id`, or None if none does."""
    from tasks.providers import run_registry
    from tasks.providers.local import TABLE

    candidates = [given] if given is not None else [run_registry.artifacts_dir_of(run_id), Path("artifacts")]
    return next((folder for folder in filter(None, candidates) if (folder / run_id / TABLE).is_file()), None)


def _run(args: argparse.Namespace) -> int:
    from tasks.providers import run_registry
    from tasks.providers.cleanup import cleanup_run

    local_hint = args.artifacts is not None or run_registry.artifacts_dir_of(args.run_id)
    provider_name = args.provider or ("local" if local_hint else "aws")
    for_other = ([flag for flag, given in (("--region", args.region), ("--config", args.config),
                                           ("--endpoint-url", args.endpoint_url), ("--wait", args.wait)) if given]
                 if provider_name == "local" else ["--artifacts"] if args.artifacts is not None else [])
    if for_other:  # it would be ignored: the user meant the other provider, or a typo
        other = "aws" if provider_name == "local" else "local"
        raise UserInputError(f"{for_other[0]} is for the {other} provider, but run {args.run_id} is cleaned up "
                             f"on {provider_name}{'' if args.provider else ' (a local run has this id; --provider aws for AWS)'}")
    aws_config = _aws_config(args) if provider_name == "aws" else None
    artifacts = _local_artifacts(args.run_id, args.artifacts) if provider_name == "local" else Path("artifacts")
    if artifacts is not None:
        terminated, where = cleanup_run(provider_name, args.run_id, artifacts_dir=artifacts, aws_config=aws_config,
                                        wait=args.wait, missing_ok=args.missing_ok)
    elif args.missing_ok:
        terminated, where = 0, str(args.artifacts or "no local run")
    else:
        where = args.artifacts if args.artifacts is not None else "the run registry or ./artifacts"
        raise UserInputError(f"no local run {args.run_id!r} found in {where} (--missing-ok to accept an unknown run id)")
    if args.json:
        print_json({"provider": provider_name, "run_id": args.run_id, "where": where, "terminated": terminated})
    else:
        print(f"terminated {terminated} instance(s) of run {args.run_id} ({provider_name}, {where})")
    return 0
