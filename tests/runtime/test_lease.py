"""The run's lease (tasks/runtime/lease.py): renewals, expiry, the PS's view of it, and the
orchestrator keeping it while the PS starts (driver.start_run)."""
from __future__ import annotations

from tasks.providers.base import Instance, InstanceType, LaunchResult, Provider
from tasks.runtime import driver, lease
from tasks.runtime.lease import LeaseWatch
from tasks.runtime.ps import READY_FILE


def test_a_renewal_moves_the_expiry(tmp_path):
    path = tmp_path / lease.LEASE_FILE
    assert lease.expiry_s(path) is None
    assert lease.renew(path, 30.0, now_s=1000.0) == 1030.0
    assert lease.expiry_s(path) == 1030.0
    lease.renew(path, 30.0, now_s=1010.0)
    assert lease.expiry_s(path) == 1040.0


def test_the_watch_lapses_only_once_no_renewal_came_in_time(tmp_path):
    path = tmp_path / lease.LEASE_FILE
    lease.renew(path, 10.0, now_s=1000.0)
    watch = LeaseWatch(path, check_every_s=5.0)
    assert not watch.lapsed(now_s=1009.0)
    lease.renew(path, 10.0, now_s=1008.0)  # renewed between two of the watch's reads
    assert not watch.lapsed(now_s=1010.0)  # the old expiry has passed: read again before calling it lapsed
    assert not watch.lapsed(now_s=1017.9)
    assert watch.lapsed(now_s=1018.0)


def test_an_unreadable_lease_keeps_the_last_expiry_read(tmp_path):
    path = tmp_path / lease.LEASE_FILE
    lease.renew(path, 10.0, now_s=1000.0)
    watch = LeaseWatch(path, check_every_s=0.0)
    path.write_text("{not json")
    assert not watch.lapsed(now_s=1005.0)
    path.unlink()
    assert not watch.lapsed(now_s=1009.0)
    assert watch.lapsed(now_s=1010.0)


def test_no_lease_at_start_is_lapsed(tmp_path):
    assert LeaseWatch(tmp_path / lease.LEASE_FILE).lapsed(now_s=0.0)


class _SlowStartProvider(Provider):
    """A PS that listens only once the orchestrator has renewed the run's lease `renewals` times
    while it waited: a start-up longer than the lease. No process: the instance is a record."""

    def __init__(self, run_dir, renewals: int):
        self.run_dir, self.renewals, self.expiries = run_dir, renewals, []

    def list_types(self):
        return [InstanceType("p3.2xlarge", 1, "V100", 16.0, 1250.0, 3.06, 0.92)]

    def launch(self, run_id, plan_id, instance_type, count, *, role="worker", market="spot", startup=None):
        self.instance = Instance("i-ps", instance_type, role, market, "running", run_id, plan_id, "127.0.0.1")
        return LaunchResult([self.instance])

    def describe(self, run_id):
        expiry = lease.expiry_s(self.run_dir / lease.LEASE_FILE)
        if not self.expiries or expiry != self.expiries[-1]:
            self.expiries.append(expiry)
        if len(self.expiries) > self.renewals:
            (self.run_dir / READY_FILE).write_text("{}")
        return [self.instance]

    def terminate(self, instance_ids):
        pass

    def poll_events(self, run_id):
        return []


def test_the_lease_is_kept_while_the_parameter_server_starts(tmp_path, monkeypatch):
    """A PS that starts slower than the lease is short does not find it lapsed: the orchestrator
    renews it while it waits for the PS to listen, not only once the run trains."""
    monkeypatch.setattr(lease, "RENEW_EVERY_S", 0.0)
    provider = _SlowStartProvider(tmp_path / "r", renewals=3)
    run = driver.start_run(provider, "r", "tests.plugins.regression:build", run_dir=tmp_path / "r", lease_s=600.0,
                           ready_timeout_s=60.0)
    assert len(provider.expiries) == 4 and provider.expiries == sorted(provider.expiries)
    assert lease.expiry_s(run.lease_place) >= provider.expiries[-1]
