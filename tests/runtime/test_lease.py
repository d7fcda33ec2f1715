"""The run's lease (tasks/runtime/lease.py): renewals, expiry, and the PS's view of it."""
from __future__ import annotations

from tasks.runtime import lease
from tasks.runtime.lease import LeaseWatch


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
