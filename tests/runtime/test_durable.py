"""Durable checkpoints (tasks/runtime/durable.py) against moto's S3 over HTTP: the PS copies each
checkpoint to the bucket, keeps the newest there, and a PS on a new disk starts from them; the
run's lease kept in the bucket, where a PS on another machine reads it."""
from __future__ import annotations

import os
import time
import uuid

import boto3
import pytest
import torch

from tasks.core.errors import UserInputError
from tasks.runtime import lease
from tasks.runtime.driver import lease_place
from tasks.runtime.durable import S3Checkpoints
from tasks.runtime.ps import ParameterServer, PsConfig
from tasks.runtime.telemetry import read_records

pytestmark = pytest.mark.integration  # a server: moto
BUCKET = "spotfill-checkpoints"


@pytest.fixture()
def s3(moto_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # what the PS's boto3 client finds
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3")
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    return client


def ps(run_dir, url) -> ParameterServer:
    return ParameterServer(PsConfig(run_dir=run_dir, port=0, workload="resnet20", workload_options={"width": 4},
                                    durable_url=url))


def test_checkpoints_land_in_the_bucket_and_a_new_ps_starts_from_them(s3, tmp_path):
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    first = ps(tmp_path / "old-disk", url)
    assert not first.resume()  # nothing anywhere yet
    for version in (7, 9, 11):
        first.state.add_(0.5)
        first.version = first.updates_total = version
        first.write_checkpoint()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=url.split("/", 3)[3])["Contents"]]
    assert [k.rsplit("/", 1)[1] for k in sorted(keys)] == ["ckpt-000000009.pt", "ckpt-000000011.pt"]
    copied = [r["version"] for r in read_records(tmp_path / "old-disk") if r["kind"] == "durable_checkpoint"]
    assert copied == [7, 9, 11]

    second = ps(tmp_path / "new-disk", url)  # a PS restarted on a new instance: an empty disk
    assert second.resume()
    assert second.version == 11 and torch.equal(second.state, first.state)
    assert S3Checkpoints(url, s3).fetch_newest(second.checkpoint_dir) is None  # its disk is as new now


def test_an_unreadable_store_is_one_line(s3, tmp_path):
    with pytest.raises(UserInputError, match="cannot read the durable checkpoints at s3://no-such-bucket"):
        ps(tmp_path, "s3://no-such-bucket/x").resume()
    with pytest.raises(UserInputError, match="must be s3://BUCKET/PREFIX"):
        S3Checkpoints("/tmp/x", s3)


def test_a_lease_in_the_bucket_lapses_without_renewals(s3, tmp_path):
    url = lease_place(tmp_path, f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}")
    assert url.startswith(f"s3://{BUCKET}/") and url.endswith("/lease.json")
    watch = lease.LeaseWatch(url, check_every_s=0.0)
    assert watch.lapsed(now_s=0.0)  # none yet
    lease.renew(url, 10.0, now_s=1000.0)
    assert not watch.lapsed(now_s=1005.0)
    lease.renew(url, 10.0, now_s=1005.0)  # the orchestrator renews ...
    assert not watch.lapsed(now_s=1012.0)
    assert watch.lapsed(now_s=1015.0)  # ... then stops: the PS stops, and its instance shuts down
    assert lease.owner_pid(url) == os.getpid()


def test_a_live_aws_run_is_found_by_its_tags_and_taken_over(s3, moto_endpoint, moto_amis, tmp_path):
    from tasks.providers.aws import AwsConfig, AwsProvider
    from tasks.runtime.driver import attach_run
    from tests.helpers import PRICE_ARCHIVE

    provider = AwsProvider(AwsConfig(endpoint_url=moto_endpoint, ami_ids={"x86_64": moto_amis["x86_64"]},
                                     spot_price_archive=PRICE_ARCHIVE, candidate_types=["g4dn.2xlarge"]))
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    durable_url = f"s3://{BUCKET}/{run_id}"
    ps_instance = provider.launch(run_id, "ps", "g4dn.2xlarge", 1, role="ps", market="on-demand").instances[0]
    try:
        settings = {"durable_url": durable_url}
        lease.renew(lease_place(tmp_path, durable_url), 10.0)  # the old orchestrator's, about to lapse
        run = attach_run(provider, run_id, tmp_path, "10.0.0.5:29500", [ps_instance.instance_id], "resnet20", {},
                         settings, 60.0)
        assert run.ps_instance.instance_id == ps_instance.instance_id  # found by its spotfill:run-id tag
        assert lease.expiry_s(run.lease_place) > time.time() + 50  # renewed in the bucket, for the whole lease
        provider.terminate([ps_instance.instance_id])
        with pytest.raises(UserInputError, match="no longer running"):
            attach_run(provider, run_id, tmp_path, "10.0.0.5:29500", [ps_instance.instance_id], "resnet20", {},
                       settings, 60.0)
    finally:
        provider.cleanup(run_id)
