"""Terminate everything a run started, or list what of it still runs, from nothing but its id and
where it ran: stateless, so the CLI's `spotfill cleanup` and the flow's crash and cancel hooks (in
whatever process Prefect runs them) share it."""
from __future__ import annotations

from pathlib import Path

from tasks.core.errors import UserInputError
from tasks.providers.base import Instance
from tasks.providers.local import LocalProvider


def cleanup_run(provider: str, run_id: str, *, artifacts_dir: Path = Path("artifacts"),
                aws_config: dict | None = None, wait: bool = False, missing_ok: bool = True) -> tuple[int, str]:
    """Terminate every instance of the run, from nothing but its id and where it ran (the CLI,
    and the flow's crash and cancel hooks in whatever process Prefect runs them); returns how
    many were still alive, and where (the artifacts folder, or the AWS region). Without
    `missing_ok`, an AWS run id that no instance or security group carries is a UserInputError."""
    from tasks.providers.aws import check_id  # deferred: boto3 (start-up cost)

    run_id = check_id("run id", run_id)
    if provider == "local":
        return LocalProvider(artifacts_dir=artifacts_dir).cleanup(run_id), str(artifacts_dir)
    from tasks.providers.aws import TAG_RUN, AwsProvider, load_aws_config  # deferred: boto3 (start-up cost)

    aws = AwsProvider(load_aws_config(aws_config or {}))
    if not missing_ok and not aws.knows_run(run_id):
        raise UserInputError(f"no instance or security group tagged {TAG_RUN}={run_id} in {aws.config.region} "
                             "(--missing-ok to accept an unknown run id)")
    return aws.cleanup(run_id, wait=wait), aws.config.region


def running_instances(provider: str, run_id: str, *, artifacts_dir: Path = Path("artifacts"),
                      aws_config: dict | None = None) -> list[Instance]:
    """The run's instances not yet terminated (a crash hook asks whether the run lives on its lease)."""
    from tasks.providers.aws import AwsProvider, check_id, load_aws_config  # deferred: boto3 (start-up cost)

    run_id = check_id("run id", run_id)
    found = (LocalProvider(artifacts_dir=artifacts_dir) if provider == "local"
             else AwsProvider(load_aws_config(aws_config or {}))).describe(run_id)
    return [i for i in found if i.state != "terminated"]
