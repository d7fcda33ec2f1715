"""A local stand-in for AWS, for tests and `spotfill bench aws`: moto's EC2 server over real HTTP,
interruptions injected into moto's backend, and an IMDSv2 stub per instance.

moto does not interrupt spot instances by itself and does not serve spot/instance-action, so this
module does both the way AWS does them: the stub starts answering instance-action (and, on ask,
a rebalance recommendation) with the 2-minute deadline, and at the deadline the instance is
terminated with state reason Server.SpotInstanceTermination. Needs the dev extra (moto[server]).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

from tasks.providers.base import EventKind, Provider, ProviderEvent

REPO = Path(__file__).resolve().parents[2]

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
}
SPOT_TERMINATION = ("Server.SpotInstanceTermination", "Server.SpotInstanceTermination: Spot instance termination")


@contextlib.contextmanager
def moto_server(strict: bool = True) -> Iterator[str]:
    """moto's EC2 (and Service Quotas) on 127.0.0.1 at a free port; yields the endpoint URL.
    `strict` turns on moto's AMI and instance-type validation, as AWS validates them."""
    import logging

    from moto import settings
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per API call
    saved = (settings.ENABLE_AMI_VALIDATION, settings.EC2_ENABLE_INSTANCE_TYPE_VALIDATION)
    settings.ENABLE_AMI_VALIDATION = settings.EC2_ENABLE_INSTANCE_TYPE_VALIDATION = strict
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        settings.ENABLE_AMI_VALIDATION, settings.EC2_ENABLE_INSTANCE_TYPE_VALIDATION = saved


@contextlib.contextmanager
def fake_credentials() -> Iterator[None]:
    """moto's fake keys in the environment, where boto3's default chain finds them."""
    saved = {k: os.environ.get(k) for k in FAKE_CREDENTIALS}
    os.environ.update(FAKE_CREDENTIALS)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def stock_amis(ec2: object) -> dict[str, str]:
    """One of moto's stock Amazon Linux 2023 AMIs per architecture (x86_64, arm64); the name
    filter keeps the answer small (moto holds about 1,300 AMIs)."""
    amis = {}
    for arch in ("x86_64", "arm64"):
        filters = [{"Name": "architecture", "Values": [arch]}, {"Name": "name", "Values": ["al2023-ami-2023.*"]}]
        images = ec2.describe_images(Owners=["amazon"], Filters=filters)["Images"]  # type: ignore[attr-defined]
        amis[arch] = sorted(i["ImageId"] for i in images)[0]
    return amis


def revoke(region: str, instance_id: str) -> None:
    """What EC2 does at the end of a spot notice: terminate, reason Server.SpotInstanceTermination."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ec2.models import ec2_backends
    from moto.ec2.models.instances import StateReason

    instance = ec2_backends[DEFAULT_ACCOUNT_ID][region].get_instance(instance_id)
    instance.terminate()
    code, message = SPOT_TERMINATION
    instance.state_reason = StateReason(message, code)


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ImdsStub:
    """One instance's IMDSv2, as far as the watcher uses it: token PUT, instance-id,
    spot/instance-action and events/recommendations/rebalance (404 until posted). Requests
    without a valid token get 401, as IMDSv2 with HttpTokens=required answers."""

    def __init__(self, instance_id: str):
        self.instance_id = instance_id
        self.token = f"token-{instance_id}"
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.noticed_at_s: float | None = None
        self.asked_instance_id = threading.Event()  # the watcher is up and has its instance id
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, stub.token)
                else:
                    self._send(400)

            def do_GET(self) -> None:
                if self.headers.get("X-aws-ec2-metadata-token") != stub.token:
                    self._send(401)
                    return
                answers = {
                    "/latest/meta-data/instance-id": stub.instance_id,
                    "/latest/meta-data/spot/instance-action": stub.instance_action and json.dumps(stub.instance_action),
                    "/latest/meta-data/events/recommendations/rebalance": stub.rebalance and json.dumps(stub.rebalance),
                }
                body = answers.get(self.path)
                if self.path.endswith("/instance-id"):
                    stub.asked_instance_id.set()
                self._send(200, body) if body else self._send(404)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def post_notice(self, lead_s: float = 120.0, action: str = "terminate") -> float:
        """Post the spot interruption notice now; returns when it was posted (epoch seconds)."""
        self.noticed_at_s = time.time()
        self.instance_action = {"action": action, "time": _iso(self.noticed_at_s + lead_s)}
        return self.noticed_at_s

    def post_rebalance(self) -> None:
        self.rebalance = {"noticeTime": _iso(time.time())}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def watched_instance(instance_id: str, region: str, endpoint_url: str, poll_s: float) -> Iterator[ImdsStub]:
    """An IMDS stub for the instance and the real watcher process (as user data starts it)
    polling it; yields once the watcher is up."""
    stub = ImdsStub(instance_id)
    argv = [sys.executable, "-m", "tasks.providers.imds_watcher", "--region", region,
            "--metadata-url", stub.url, "--endpoint-url", endpoint_url, "--poll-s", str(poll_s)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        if not stub.asked_instance_id.wait(timeout=60):
            raise TimeoutError(f"the IMDS watcher for {instance_id} did not start within 60 s")
        yield stub
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        stub.close()


def wait_for_event(
    provider: Provider, run_id: str, kind: EventKind, instance_id: str, poll_s: float, timeout_s: float = 60.0
) -> tuple[ProviderEvent, float]:
    """Poll as the orchestrator does until the event shows; returns it and when it was seen."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        for event in provider.poll_events(run_id):
            if event.kind == kind and event.instance_id == instance_id:
                return event, time.time()
        time.sleep(poll_s)
    raise TimeoutError(f"no {kind} event for {instance_id} within {timeout_s:g} s")
