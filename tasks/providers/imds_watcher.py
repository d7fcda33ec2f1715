"""On each spot instance: watch IMDSv2 for the 2-minute interruption notice and for rebalance
recommendations, and relay them to the orchestrator by tagging the instance itself.

Why a tag: the orchestrator already reads the run's instances (with their tags) on every poll, the
tag needs no inbound port or address for the orchestrator (it may sit behind NAT, on a laptop), it
works on moto as on AWS, and it survives the instance (terminated instances stay described for
about an hour). It costs the instance one CreateTags per notice; its instance profile needs
ec2:CreateTags on itself only (docs/aws-iam-policy.json).

Run as `python -m tasks.providers.imds_watcher --region R [--metadata-url URL] [--poll-s S]`; the
provider's user data starts it on every spot instance.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Literal

log = logging.getLogger(__name__)

TOKEN_TTL_S = 21600
TAG_NOTICE = "spotfill:notice"  # the same keys the provider reads (tasks.providers.aws)
TAG_REBALANCE = "spotfill:rebalance"


def parse_time_s(stamp: str) -> float:
    """IMDS times ('2017-09-18T08:22:00Z') as epoch seconds."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Imds:
    """An IMDSv2 session: a PUT for a token, then GETs that carry it (a token expired or refused
    is fetched again once)."""

    def __init__(self, base_url: str, timeout_s: float = 2.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token: str | None = None

    def _fetch_token(self) -> str:
        request = urllib.request.Request(
            f"{self.base_url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            return reply.read().decode()

    def get(self, path: str) -> str | None:
        """meta-data/<path>, or None when IMDS has nothing there (404: no notice yet)."""
        for attempt in range(2):
            if self._token is None:
                self._token = self._fetch_token()
            request = urllib.request.Request(
                f"{self.base_url}/latest/meta-data/{path}", headers={"X-aws-ec2-metadata-token": self._token}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                    return reply.read().decode()
            except urllib.error.HTTPError as err:
                if err.code == 404:
                    return None
                if err.code == 401 and attempt == 0:
                    self._token = None
                    continue
                raise
        return None


@dataclass(frozen=True)
class Notice:
    kind: Literal["revocation_notice", "rebalance"]
    time_s: float  # when the instance will be taken (notice) or when EC2 issued the hint
    seen_s: float  # when this watcher saw it
    action: str | None = None  # terminate, stop or hibernate

    def tag(self) -> dict[str, str]:
        if self.kind == "revocation_notice":
            value = {"action": self.action, "time_s": self.time_s, "seen_s": self.seen_s}
            return {"Key": TAG_NOTICE, "Value": json.dumps(value)}
        return {"Key": TAG_REBALANCE, "Value": json.dumps({"notice_s": self.time_s, "seen_s": self.seen_s})}


def check(imds: Imds) -> list[Notice]:
    """What IMDS says now: the spot instance-action and the rebalance recommendation, if posted."""
    seen_s = time.time()
    notices = []
    action = imds.get("spot/instance-action")
    if action:
        body = json.loads(action)
        notices.append(Notice("revocation_notice", parse_time_s(body["time"]), seen_s, body["action"]))
    rebalance = imds.get("events/recommendations/rebalance")
    if rebalance:
        notices.append(Notice("rebalance", parse_time_s(json.loads(rebalance)["noticeTime"]), seen_s))
    return notices


def tag_relay(ec2: Any, instance_id: str) -> Callable[[Notice], None]:
    """Relay a notice by tagging this instance (the orchestrator's poll reads the tag)."""

    def relay(notice: Notice) -> None:
        ec2.create_tags(Resources=[instance_id], Tags=[notice.tag()])

    return relay


def watch(imds: Imds, relay: Callable[[Notice], None], poll_s: float, stop: threading.Event) -> None:
    """Poll until stopped; relay each kind of notice once. An IMDS or relay failure is logged and
    tried again at the next poll: the notice must get through while the instance lives."""
    relayed: set[str] = set()
    while not stop.is_set() and len(relayed) < 2:
        try:
            for notice in check(imds):
                if notice.kind not in relayed:
                    relay(notice)
                    relayed.add(notice.kind)
                    log.info("relayed %s (instance taken at %.0f)", notice.kind, notice.time_s)
        except Exception as err:  # noqa: BLE001 - keep watching whatever one poll hit
            log.warning("watcher poll failed: %s", type(err).__name__)
        stop.wait(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="imds_watcher", description=__doc__.splitlines()[0])
    parser.add_argument("--region", required=True)
    parser.add_argument("--metadata-url", default="http://169.254.169.254")
    parser.add_argument("--endpoint-url", default=None, help="another EC2 endpoint (moto)")
    parser.add_argument("--poll-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    import boto3

    imds = Imds(args.metadata_url)
    instance_id = imds.get("instance-id")
    if instance_id is None:
        sys.stderr.write("imds_watcher: IMDS has no instance-id\n")
        return 2
    ec2 = boto3.client("ec2", region_name=args.region, endpoint_url=args.endpoint_url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        watch(imds, tag_relay(ec2, instance_id), args.poll_s, stop)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
