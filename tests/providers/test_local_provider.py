"""The local provider with light instances (sleeping processes): launch, idempotency, capacity,
revocation deadlines, trace replay, cleanup from another process, no leaks after a crash or
Ctrl-C of the process that started them."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.core.errors import UserInputError
from tasks.providers.base import Startup
from tasks.providers.local import LocalProvider, _proc_start_ticks, default_types
from tests.helpers import REPO, sleeper_startup

SLEEPER = sleeper_startup()
GROUP = Startup(("bash", "-c", "sleep 120 & sleep 120 & wait"))
TRACE = REPO / "profiles" / "traces" / "bamboo_aws-spot-instances-g4dn-xlarge-us-east-1d-2020-11-23-1730-to-2020-11-24-1530.csv"


@pytest.fixture()
def provider(tmp_path):
    p = LocalProvider(tmp_path, terminate_grace_s=2.0)
    yield p
    p.kill_all_started()


def _group_gone(pgid: int) -> bool:
    """No live (non-zombie) process is left in the process group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return False
    return True


def _wait(predicate, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_default_types_come_from_the_shipped_profile():
    types, speed = default_types()
    by_name = {t.name: t for t in types}
    assert by_name["p3.2xlarge"].spot_usd_per_h == 0.918 and by_name["p3.2xlarge"].gpu_model == "NVIDIA Tesla V100"
    assert speed["p3.2xlarge"] == 1.0
    assert speed["g4dn.4xlarge"] == pytest.approx(0.378964 / 1.201062)


def test_a_provider_made_in_a_flow_run_leaves_prefects_sigterm_handler_in_place(tmp_path):
    """Prefect's runner acknowledges a cancel only while its flow engine's SIGTERM handler is
    installed; replaced, the cancel's SIGTERM is recorded as a crash (Running, Cancelling, Crashed).
    The provider's own handler goes in front of Python's defaults and of other providers' only."""
    from prefect.utilities.engine import can_ack_control_intent, capture_sigterm

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with capture_sigterm():
            first, second = LocalProvider(tmp_path), LocalProvider(tmp_path)
            assert can_ack_control_intent()
            ctrl_c = signal.getsignal(signal.SIGINT)
            assert ctrl_c.provider is second and ctrl_c.previous.provider is first  # both kill on Ctrl-C
            assert ctrl_c.previous.previous is saved[signal.SIGINT]
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        LocalProvider(tmp_path)
        assert signal.getsignal(signal.SIGTERM).previous == signal.SIG_DFL  # outside a flow run it kills on SIGTERM
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.integration
def test_launch_is_idempotent_and_terminate_kills_the_group(provider):
    first = provider.launch("r", "p0", "p3.2xlarge", 2, startup=GROUP)
    again = provider.launch("r", "p0", "p3.2xlarge", 2, startup=GROUP)
    assert [i.instance_id for i in first.instances] == [i.instance_id for i in again.instances]
    assert len(provider.describe("r")) == 2
    pids = [provider.pid_of("r", i.instance_id) for i in first.instances]
    provider.terminate([first.instances[0].instance_id, "local-9999"])  # an unknown id is no error
    _wait(lambda: _group_gone(pids[0]))  # a SIGKILLed process takes a moment to exit under load
    assert not _group_gone(pids[1])
    assert provider.cleanup("r") == 1
    assert provider.describe("r") == []
    _wait(lambda: _group_gone(pids[1]))


@pytest.mark.integration
@pytest.mark.parametrize("end", ["exits", "terminated", "killed"])
def test_a_retry_returns_only_live_instances(provider, end):
    """A launch again under a plan id whose instances have ended starts new ones (a run resumed
    by its id), however they ended; while one still runs, it is the answer."""
    quick = Startup(("python", "-c", "pass")) if end == "exits" else SLEEPER
    (first,) = provider.launch("r", "ps", "p3.2xlarge", 1, role="ps", market="on-demand", startup=quick).instances
    pid = provider.pid_of("r", first.instance_id)
    if end == "terminated":
        provider.terminate([first.instance_id])
    elif end == "killed":
        subprocess.run(["kill", "-9", str(pid)], check=True)
    _wait(lambda: provider.describe("r") == [])
    (second,) = provider.launch("r", "ps", "p3.2xlarge", 1, role="ps", market="on-demand", startup=SLEEPER).instances
    assert second.instance_id != first.instance_id and second.state == "running"
    again = provider.launch("r", "ps", "p3.2xlarge", 1, role="ps", market="on-demand", startup=SLEEPER)
    assert [i.instance_id for i in again.instances] == [second.instance_id]


@pytest.mark.integration
def test_capacity_limits_spot_launches(provider):
    provider.capacity["g3.8xlarge"] = 1
    result = provider.launch("r", "p0", "g3.8xlarge", 3, startup=SLEEPER)
    assert len(result.instances) == 1
    refusal = result.refused["g3.8xlarge"]
    assert (refusal.kind, refusal.missing) == ("capacity", 2) and "has 1 free, asked 3" in refusal.message
    with pytest.raises(UserInputError, match="unknown instance type"):
        provider.launch("r", "p1", "x9.huge", 1, startup=SLEEPER)


@pytest.mark.integration
def test_notice_then_taken_at_the_deadline(provider):
    (instance,) = provider.launch("r", "p0", "p3.2xlarge", 1, startup=SLEEPER).instances
    notice = provider.inject_revocation("r", instance.instance_id, notice_s=0.5)
    notice_file = Path(json.loads((provider.run_dir("r") / "instances.json").read_text())["instances"][0]["notice_file"])
    assert json.loads(notice_file.read_text())["deadline_s"] == notice.deadline_s
    assert provider.describe("r")[0].state == "notice"
    pid = provider.pid_of("r", instance.instance_id)
    _wait(lambda: _group_gone(pid))  # a sleeper ignores the notice: it is taken at the deadline
    assert time.time() >= notice.deadline_s
    assert [e.kind for e in provider.poll_events("r")] == ["revocation_notice", "revoked"]
    assert provider.poll_events("r") == []


@pytest.mark.integration
def test_trace_replay_revokes_at_scaled_times(provider):
    provider.launch("r", "p0", "g4dn.4xlarge", 2, startup=SLEEPER)
    # first drop in this real trace: 2 -> 1 live at 25529 s; 50000x faster is 0.51 s
    start = time.time()
    provider.replay_trace("r", TRACE, time_scale=50_000.0, notice_s=5.0)
    _wait(lambda: any(i.state == "notice" for i in provider.describe("r")))
    assert time.time() - start >= 25529 / 50_000 - 0.05  # not before its scaled time (later is the machine's load)
    events = provider.poll_events("r")
    assert events[0].kind == "revocation_notice" and events[0].deadline_s - events[0].at_s == pytest.approx(5.0)


@pytest.mark.integration
def test_a_trace_replay_taken_over_skips_what_was_played_and_plays_what_fell_due(provider, tmp_path):
    """Another orchestrator began the replay 201 s ago and played its first 150 s: the drop at
    100 s is not played again, the one at 200 s (missed while no one watched) is played at once,
    the one at 203 s on time. Played again, the first drop would make three notices, not two."""
    trace = tmp_path / "g4dn-taken-over.csv"
    trace.write_text("0,4\n100,3\n200,2\n203,1\n300,1\n")  # drops of 1/4, 1/3 and 1/2
    provider.launch("r", "p0", "g4dn.4xlarge", 4, startup=SLEEPER)
    started_s = time.time() - 201.0
    provider.replay_trace("r", trace, time_scale=1.0, notice_s=60.0, started_s=started_s, played_s=150.0).join(timeout=60)
    notices = [e for e in provider.poll_events("r") if e.kind == "revocation_notice"]
    assert len(notices) == 2  # 1/3 of 4: one (a third carried), then 1/2 of 3 plus the third: one
    assert notices[-1].at_s >= started_s + 203.0  # not before its time


@pytest.mark.integration
def test_cleanup_from_another_process_object(provider, tmp_path):
    provider.launch("r", "p0", "p3.2xlarge", 2, startup=SLEEPER)
    pids = [provider.pid_of("r", i.instance_id) for i in provider.describe("r")]
    assert LocalProvider(tmp_path).cleanup("r") == 2
    assert all(_proc_start_ticks(pid) is None or _group_gone(pid) for pid in pids)


DRIVER = """
import json, sys, time
from dataclasses import replace
from pathlib import Path
from tasks.providers.base import Startup
from tasks.providers.local import LocalProvider
p = LocalProvider(Path(sys.argv[1]))
r = p.launch("leak", "p0", "p3.2xlarge", 2, startup=Startup(("bash", "-c", "sleep 120 & sleep 120 & wait")))
print(json.dumps([p.pid_of("leak", i.instance_id) for i in r.instances]), flush=True)
if sys.argv[2] == "raise":
    raise RuntimeError("boom")
time.sleep(60)
"""


@pytest.mark.integration
@pytest.mark.parametrize("how", ["raise", "sigint", "sigterm"])
def test_no_process_outlives_its_starter(tmp_path, how):
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), how], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pgids = json.loads(proc.stdout.readline())
        if how != "raise":
            assert not any(_group_gone(g) for g in pgids)
            proc.send_signal(signal.SIGINT if how == "sigint" else signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    _wait(lambda: all(_group_gone(g) for g in pgids))


@pytest.mark.integration
def test_nic_bandwidth_is_megabytes_per_s_in_the_type_and_megabits_in_the_shaping(tmp_path):
    from tasks.core.catalog import load_catalog

    catalog_mbytes = next(t["network_mbps"] for t in load_catalog()["types"] if t["type"] == "p3.2xlarge")
    p = LocalProvider(tmp_path, bandwidth_scale=0.5, terminate_grace_s=2.0)
    try:
        itype = next(t for t in p.list_types() if t.name == "p3.2xlarge")
        assert itype.network_mbytes_per_s == catalog_mbytes  # the AWS catalog's unit, unchanged
        instance = p.launch("r", "p0", "p3.2xlarge", 1, startup=SLEEPER).instances[0]
        environ_path = Path(f"/proc/{p.pid_of('r', instance.instance_id)}/environ")

        def child_env() -> dict[str, str]:  # the parent's until the child has exec'd its startup
            environ = environ_path.read_bytes().split(b"\0")
            return dict(e.decode().split("=", 1) for e in environ if b"=" in e)

        _wait(lambda: "SPOTFILL_NIC_MBPS" in child_env(), timeout_s=120.0)
        assert float(child_env()["SPOTFILL_NIC_MBPS"]) == pytest.approx(8 * catalog_mbytes * 0.5)  # megabits/s
    finally:
        p.kill_all_started()


@pytest.mark.integration
def test_a_detached_instance_is_not_told_to_watch_its_starter(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOTFILL_WATCH_PID", "1")  # inherited from an outer orchestrator: not passed on either
    p = LocalProvider(tmp_path, terminate_grace_s=2.0)
    try:
        watched = p.launch("r", "p0", "p3.2xlarge", 1, startup=SLEEPER).instances[0]
        detached = p.launch("r", "p1", "p3.2xlarge", 1, startup=replace(SLEEPER, detached=True)).instances[0]

        def child_env(instance) -> dict[str, str]:  # the parent's until the child has exec'd its startup
            environ = Path(f"/proc/{p.pid_of('r', instance.instance_id)}/environ").read_bytes().split(b"\0")
            return dict(e.decode().split("=", 1) for e in environ if b"=" in e)

        _wait(lambda: all("SPOTFILL_INSTANCE_ID" in child_env(i) for i in (watched, detached)), timeout_s=120.0)
        assert child_env(watched)["SPOTFILL_WATCH_PID"] == str(os.getpid())
        assert "SPOTFILL_WATCH_PID" not in child_env(detached)
    finally:
        p.kill_all_started()


def test_a_signal_the_process_ignores_stays_ignored(tmp_path):
    """A command started with SIGINT ignored (a background job of a script) is not stopped by it:
    the provider adds no handler that would stop its processes (and leave the command running)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        LocalProvider(tmp_path)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_full_disk_does_not_stop_the_clean_up(tmp_path, monkeypatch):
    """Terminating (a run's clean-up) only records processes that have ended: on a full disk the
    record waits for the next look instead of failing the clean-up; other writes still fail."""
    import errno

    from tasks.providers import local

    provider = LocalProvider(tmp_path)
    row = {"instance_id": "local-r-0000", "type": "p3.2xlarge", "role": "ps", "market": "on-demand",
           "state": "running", "run_id": "r", "plan_id": "ps", "address": "127.0.0.1", "launched_at_s": 0.0,
           "pid": 2**22 + 1, "start_ticks": None, "notice_file": None, "notice_deadline_s": None}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "instances.json").write_text(json.dumps({"instances": [row], "events": [], "next_id": 1}))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "atomic_write_text", full)
    provider.terminate(["local-r-0000"])
    assert provider.describe("r") == []
    with pytest.raises(OSError, match="No space left"):
        provider.poll_events("r")
