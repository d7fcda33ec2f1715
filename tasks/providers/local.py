"""The `local` provider: an emulated spot cloud on this machine.

Each instance is a local process (its Startup argv; "python" means this interpreter) started in
its own process group, with its output in <artifacts>/<run-id>/logs/<instance-id>.log. Its
instance type shapes it: the provider passes SPOTFILL_INSTANCE_ID, SPOTFILL_INSTANCE_TYPE,
SPOTFILL_RELATIVE_SPEED (the worker pads its compute to it), SPOTFILL_NIC_MBPS (the type's network
bandwidth in megabits/s times `bandwidth_scale`, which the PS shapes the worker's traffic to; bandwidth_scale=None:
not shaped), SPOTFILL_GPUS (the type's GPUs: the worker runs that many replicas on the CPU, an
emulated multi-GPU instance), SPOTFILL_PCIE_MBPS (the profile's PCIe bandwidth times
`bandwidth_scale`, in megabits/s, which the replicas' gradient sum is paced to), SPOTFILL_NOTICE_FILE
and, if set, SPOTFILL_REFERENCE_COMPUTE_S in the environment.

The instance table (and the events not yet polled) lives in <artifacts>/<run-id>/instances.json,
rewritten atomically, so `describe` and `cleanup(run_id)` work from another process. Every process
a LocalProvider starts is also killed when the starting process exits (atexit) or gets
SIGTERM/SIGINT (those after a SIGTERM and up to terminate_grace_s to leave: a PS writes its final
checkpoint), unless other code handles that signal, as Prefect's flow engine does SIGTERM: its
exception unwinds the process, whose cleanup and atexit end them. Should it be killed outright
(SIGKILL), the PS and workers see that the pid in SPOTFILL_WATCH_PID is gone and stop by
themselves. A detached Startup gets no SPOTFILL_WATCH_PID: its run's lease ends it instead
(tasks/runtime/lease.py), so it trains on while no one watches.

Revocations: `inject_revocation(run_id, instance_id, notice_s)` writes the instance's notice file,
records a `revocation_notice` event, and takes the instance at the deadline (SIGKILL to its
process group) if it has not left by then (`revoked` event). `replay_trace` does the same from a
real trace (tasks.core.traces), time-scaled: at every drop of the trace's live count, the
same fraction of the run's running spot workers get a notice. `replay_capacity` plays a capacity
trace against one type (tasks/providers/capacity_replay.py): spot launches above it are refused,
a drop below what runs revokes the excess; on-demand instances are never refused nor revoked by it.

Default types: the shipped profile's instance types (profiles/resnet110-cifar100.json: prices,
speeds) with GPU and network facts from the instance catalog (tasks/core/catalog.py). Relative speed is a
type's samples per second (gpus * batch_per_gpu / compute_time_s) over the fastest type's.
"""
from __future__ import annotations

import atexit
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from tasks.core.atomic import atomic_write_text
from tasks.core.capacity import CapacityTrace
from tasks.core.catalog import load_catalog
from tasks.core.errors import UserInputError
from tasks.core.inputs import read_json
from tasks.core.traces import load_trace
from tasks.providers import capacity_replay, run_registry
from tasks.providers.base import (
    Instance, InstanceType, LaunchResult, Market, Provider, ProviderEvent, Refusal, Role, Startup,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = REPO / "profiles" / "resnet110-cifar100.json"
TABLE = "instances.json"


def default_types(profile_path: Path = DEFAULT_PROFILE) -> tuple[list[InstanceType], dict[str, float]]:
    """The shipped profile's instance types and their relative speeds."""
    profile = json.loads(profile_path.read_text())
    facts = {t["type"]: t for t in load_catalog()["types"]}
    types, throughput = [], {}
    for p in profile["instances"]:
        f = facts.get(p["type"], {})
        types.append(InstanceType(
            name=p["type"], gpus=p["gpus"], gpu_model=f.get("gpu_model") or "unknown",
            gpu_memory_gb=float(f.get("gpu_memory_gb") or 0), network_mbytes_per_s=float(f.get("network_mbps") or 125.0),
            on_demand_usd_per_h=p["on_demand_price"], spot_usd_per_h=p["spot_price"],
        ))
        throughput[p["type"]] = p["gpus"] * p["batch_per_gpu"] / p["compute_time_s"]
    fastest = max(throughput.values())
    return types, {name: value / fastest for name, value in throughput.items()}


def default_pcie_mbytes_per_s(profile_path: Path = DEFAULT_PROFILE) -> float:
    """The shipped profile's PCIe bandwidth (MB/s), which the local provider emulates inside a
    multi-GPU instance."""
    return float(json.loads(profile_path.read_text())["pcie_bandwidth_mbps"])


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a reused pid apart); None if gone/zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def child_pythonpath() -> str:
    """The repository, the launching folder (where a `module:function` plug-in may live) and the
    caller's PYTHONPATH, all absolute: the instances run in the repository folder."""
    entries = [str(REPO), os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(os.path.abspath(e) for e in entries))




_NUMBER, _TEXT = (int, float), (str,)
ROW_TYPES = {"instance_id": _TEXT, "type": _TEXT, "role": _TEXT, "market": _TEXT, "state": _TEXT, "run_id": _TEXT,
             "plan_id": _TEXT, "address": _TEXT, "launched_at_s": _NUMBER, "pid": (int,),
             "start_ticks": (int, type(None)), "notice_file": (str, type(None)),
             "notice_deadline_s": (int, float, type(None))}


def _is_row(row) -> bool:
    return (isinstance(row, dict) and row.keys() >= ROW_TYPES.keys()
            and all(type(row[key]) in kinds for key, kinds in ROW_TYPES.items()) and row["pid"] > 0)


def _is_table(table) -> bool:
    """The shape _save writes: {"instances": [row, ...], "events": [...], "next_id": int}, each
    row's fields of the types launch writes (a hand-edited table fails here, not in a comparison)."""
    return (isinstance(table, dict) and isinstance(table.get("instances"), list)
            and isinstance(table.get("events"), list) and type(table.get("next_id")) is int
            and all(_is_row(row) for row in table["instances"]))


class LocalProvider(Provider):
    name = "local"

    def __init__(
        self,
        artifacts_dir: Path = REPO / "artifacts",
        types: list[InstanceType] | None = None,
        relative_speed: dict[str, float] | None = None,
        *,
        bandwidth_scale: float | None = 1.0,
        reference_compute_s: float | None = None,
        terminate_grace_s: float = 10.0,
        pcie_mbytes_per_s: float | None = None,
    ):
        if types is None:
            types, default_speed = default_types()
            relative_speed = relative_speed or default_speed
        self.types = {t.name: t for t in types}
        self.relative_speed = relative_speed or {t.name: 1.0 for t in types}
        self.artifacts_dir = Path(artifacts_dir).resolve()  # the instances run in the repository folder
        self.bandwidth_scale = bandwidth_scale
        self.pcie_mbytes_per_s = pcie_mbytes_per_s or default_pcie_mbytes_per_s()
        self.reference_compute_s = reference_compute_s
        self.terminate_grace_s = terminate_grace_s
        self.capacity: dict[str, int] = {}  # type -> instances the emulated market has now (traces)
        self._lock = threading.RLock()
        self._children: dict[int, subprocess.Popen] = {}
        self._timers: list[threading.Timer] = []
        self._first_notices: dict[str, threading.Event] = {}  # run id -> set at its first revocation notice
        self._stop_replays = threading.Event()
        self._stopping = False  # stop_all_started under way
        atexit.register(self.kill_all_started)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous = signal.getsignal(sig)
                if _may_go_in_front_of(previous):
                    signal.signal(sig, _KillOnSignal(self, previous))

    # ------------------------------------------------------------ the table

    def run_dir(self, run_id: str) -> Path:
        return self.artifacts_dir / run_id

    def _load(self, run_id: str) -> dict:
        path = self.run_dir(run_id) / TABLE
        if not path.exists():
            return {"instances": [], "events": [], "next_id": 0}
        table = read_json(path, "instance table")
        if not _is_table(table):
            raise UserInputError(f"instance table {path} is not one spotfill wrote (edited by hand?), so it "
                                 "cannot tell which processes that run started")
        return table

    def _save(self, run_id: str, table: dict, *, settled_only: bool = False) -> None:
        """Rewritten at every poll, and worth nothing after a power cut (its processes die too).
        `settled_only`: the change only records processes that have ended, which the next look
        settles the same again, so a full disk does not stop it (nor the run's clean-up)."""
        try:
            atomic_write_text(self.run_dir(run_id) / TABLE, json.dumps(table, indent=1), fsync=False)
        except OSError as err:
            if not (settled_only and err.errno in (errno.ENOSPC, errno.EDQUOT)):
                raise

    def _alive(self, row: dict) -> bool:
        child = self._children.get(row["pid"])
        if child is not None and child.poll() is not None:
            return False
        ticks = row["start_ticks"]  # None: the child had exited at launch (None == None is no sign of life)
        return ticks is not None and _proc_start_ticks(row["pid"]) == ticks

    def _settle(self, run_id: str, table: dict) -> bool:
        """Mark exited processes terminated and take instances whose notice ran out."""
        changed = False
        now = time.time()
        for row in table["instances"]:
            if row["state"] == "terminated":
                continue
            deadline = row.get("notice_deadline_s")
            if deadline is not None and now >= deadline:
                if self._alive(row):
                    _kill_group(row["pid"], signal.SIGKILL)
                self._reap(row["pid"])
                table["events"].append(asdict(ProviderEvent("revoked", row["instance_id"], now)))
                row["state"] = "terminated"
                changed = True
            elif not self._alive(row):
                if row["start_ticks"] is not None:  # what it started (a plug-in's helper) goes with it
                    _kill_group(row["pid"], signal.SIGKILL)
                self._reap(row["pid"])
                row["state"] = "terminated"
                changed = True
        return changed

    def _reap(self, pid: int) -> None:
        child = self._children.pop(pid, None)
        if child is not None:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------ the interface

    def list_types(self) -> list[InstanceType]:
        return list(self.types.values())

    def launch(self, run_id: str, plan_id: str, instance_type: str, count: int, *, role: Role = "worker",
               market: Market = "spot", startup: Startup | None = None) -> LaunchResult:
        if instance_type not in self.types:
            raise UserInputError(f"unknown instance type {instance_type!r}; local offers {', '.join(self.types)}")
        if startup is None:
            raise UserInputError("the local provider needs a Startup: an instance is its process")
        if count < 0:
            raise UserInputError(f"instance count must be zero or more, got {count}")
        with self._lock:
            table = self._load(run_id)
            self._settle(run_id, table)
            # a retry: what the first call started and still runs (one that exited is no answer:
            # a run resumed by its id starts its PS and workers again)
            mine = [r for r in table["instances"] if (r["plan_id"], r["type"], r["role"]) == (plan_id, instance_type, role)
                    and r["state"] != "terminated"]
            if mine:
                self._save(run_id, table)
                return LaunchResult([self._instance(r) for r in mine])
            refused = {}
            if market == "spot" and instance_type in self.capacity:
                # a revoked instance holds its capacity until its notice runs out, even if its
                # process left early: the market reclaims it at the deadline, as EC2 does
                now = time.time()
                running = sum(1 for r in table["instances"] if r["type"] == instance_type and r["market"] == "spot"
                              and (r["state"] != "terminated" or (r.get("notice_deadline_s") or 0) > now))
                free = max(0, self.capacity[instance_type] - running)
                if free < count:
                    refused[instance_type] = Refusal(instance_type, "capacity", count - free,
                                                     f"{instance_type}: the spot market has {free} free, asked {count}")
                    count = free
            started = [self._start(run_id, table, plan_id, instance_type, role, market, startup) for _ in range(count)]
            self._save(run_id, table)
            return LaunchResult([self._instance(r) for r in started], refused)

    def _start(self, run_id, table, plan_id, instance_type, role, market, startup) -> dict:
        instance_id = f"local-{run_id}-{table['next_id']:04d}"  # unique across runs: terminate() looks in every run
        table["next_id"] += 1
        run_dir = self.run_dir(run_id)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "notices").mkdir(parents=True, exist_ok=True)
        notice_file = run_dir / "notices" / instance_id
        run_registry.remember(run_id, self.artifacts_dir)  # `spotfill cleanup` finds it from any folder
        env = {
            **os.environ, **startup.env,
            "PYTHONPATH": child_pythonpath(),
            "SPOTFILL_INSTANCE_ID": instance_id,
            "SPOTFILL_INSTANCE_TYPE": instance_type,
            "SPOTFILL_RELATIVE_SPEED": repr(self.relative_speed.get(instance_type, 1.0)),
            "SPOTFILL_NOTICE_FILE": str(notice_file),
            "SPOTFILL_GPUS": str(self.types[instance_type].gpus),
        }
        if startup.detached:
            env.pop("SPOTFILL_WATCH_PID", None)  # one this process inherited is not its orchestrator
        else:
            env["SPOTFILL_WATCH_PID"] = str(os.getpid())
        if self.bandwidth_scale is not None:
            env["SPOTFILL_NIC_MBPS"] = repr(self.nic_mbps(instance_type))
            # the worker paces its replicas' sum in megabits/s; the profile's PCIe is in megabytes/s
            env["SPOTFILL_PCIE_MBPS"] = repr(8.0 * self.pcie_mbytes_per_s * self.bandwidth_scale)
        if self.reference_compute_s:
            env["SPOTFILL_REFERENCE_COMPUTE_S"] = repr(self.reference_compute_s)
        argv = [sys.executable if a == "python" else a for a in startup.argv]
        log = open(run_dir / "logs" / f"{instance_id}.log", "ab")
        try:
            proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self._children[proc.pid] = proc
        row = {
            "instance_id": instance_id, "type": instance_type, "role": role, "market": market,
            "state": "running", "run_id": run_id, "plan_id": plan_id, "address": "127.0.0.1",
            "launched_at_s": time.time(), "pid": proc.pid, "start_ticks": _proc_start_ticks(proc.pid),
            "notice_file": str(notice_file), "notice_deadline_s": None,
        }
        table["instances"].append(row)
        return row

    def nic_mbps(self, instance_type: str) -> float:
        """The bandwidth an instance of the type is shaped to, megabits/s (its NIC's megabytes/s
        times bandwidth_scale)."""
        return 8.0 * self.types[instance_type].network_mbytes_per_s * (self.bandwidth_scale or 1.0)

    @staticmethod
    def _instance(row: dict) -> Instance:
        return Instance(row["instance_id"], row["type"], row["role"], row["market"], row["state"],
                        row["run_id"], row["plan_id"], row["address"], row["launched_at_s"])

    def terminate(self, instance_ids: list[str]) -> None:
        """SIGTERM each instance's process group (a worker leaves after its current step), then
        SIGKILL what is still there after terminate_grace_s."""
        wanted = set(instance_ids)
        for run_id in self._runs():
            with self._lock:
                try:
                    table = self._load(run_id)
                except UserInputError:  # another run's table, edited by hand: it holds none of these
                    continue
                rows = [r for r in table["instances"] if r["instance_id"] in wanted and r["state"] != "terminated"]
                if not rows:
                    continue
                for r in rows:
                    if self._alive(r):
                        _kill_group(r["pid"], signal.SIGTERM)
                deadline_s = time.monotonic() + self.terminate_grace_s
                while time.monotonic() < deadline_s and any(self._alive(r) for r in rows):
                    time.sleep(0.05)
                for r in rows:
                    if r["start_ticks"] is not None:  # its group's stragglers; an unrecorded pid may be another's now
                        _kill_group(r["pid"], signal.SIGKILL)
                    self._reap(r["pid"])
                    r["state"] = "terminated"
                self._save(run_id, table, settled_only=True)

    def _runs(self) -> list[str]:
        if not self.artifacts_dir.is_dir():
            return []
        return [p.parent.name for p in self.artifacts_dir.glob(f"*/{TABLE}")]

    def describe(self, run_id: str) -> list[Instance]:
        with self._lock:
            table = self._load(run_id)
            if self._settle(run_id, table):
                self._save(run_id, table, settled_only=True)  # on a full disk the run's own error is the news
            return [self._instance(r) for r in table["instances"] if r["state"] != "terminated"]

    def poll_events(self, run_id: str) -> list[ProviderEvent]:
        with self._lock:
            table = self._load(run_id)
            self._settle(run_id, table)
            events = [ProviderEvent(**e) for e in table["events"]]
            table["events"] = []
            self._save(run_id, table)
            return events

    def pid_of(self, run_id: str, instance_id: str) -> int:
        """The process id behind an instance (fault injection in tests and demos)."""
        return next(r["pid"] for r in self._load(run_id)["instances"] if r["instance_id"] == instance_id)

    # ------------------------------------------------------------ revocations

    def inject_revocation(self, run_id: str, instance_id: str, notice_s: float) -> ProviderEvent:
        """Give the instance a revocation notice; it is taken `notice_s` seconds later."""
        with self._lock:
            table = self._load(run_id)
            row = next((r for r in table["instances"] if r["instance_id"] == instance_id), None)
            if row is None or row["state"] == "terminated":
                raise UserInputError(f"no running instance {instance_id} in run {run_id}")
            now = time.time()
            event = ProviderEvent("revocation_notice", instance_id, now, now + notice_s)
            Path(row["notice_file"]).write_text(json.dumps({"deadline_s": event.deadline_s}))
            row["state"] = "notice"
            row["notice_deadline_s"] = event.deadline_s
            table["events"].append(asdict(event))
            self._save(run_id, table)
        self.first_notice(run_id).set()
        timer = threading.Timer(notice_s, self.describe, args=(run_id,))  # takes it at the deadline
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return event

    def replay_trace(self, run_id: str, trace_path: Path, time_scale: float, notice_s: float,
                     instance_type: str | None = None, *, started_s: float | None = None,
                     played_s: float = 0.0) -> threading.Thread:
        """Replay a trace's revocations against this run's spot workers, `time_scale` trace seconds
        per real second, in a background thread (returned; it ends with the trace). A drop that
        took a fraction f of the trace's instances gives f of the run's running spot workers a
        notice; fractions of a worker carry over to the next drop, so a 32-node trace maps onto a
        4-worker run in proportion. The replay's clock starts now, or at `started_s` (time.time())
        for a replay another process began (`spotfill run --resume`): the drops of its first
        `played_s` real seconds are not played again, and those since (while no one watched) at once."""
        trace = load_trace(trace_path)
        drops = [(at_s / time_scale, fraction) for at_s, fraction
                 in zip(trace.event_times_s.tolist(), trace.revoked_fraction.tolist()) if at_s / time_scale > played_s]
        start_s = time.monotonic() - (0.0 if started_s is None else max(0.0, time.time() - started_s))

        def replay() -> None:
            carry = 0.0
            for due_s, fraction in drops:
                delay_s = due_s - (time.monotonic() - start_s)
                if delay_s > 0:
                    time.sleep(delay_s)
                victims = [i for i in self.describe(run_id) if i.role == "worker" and i.market == "spot"
                           and i.state == "running" and instance_type in (None, i.type)]
                carry += fraction * len(victims)
                taken = min(len(victims), int(carry + 1e-9))
                carry -= taken
                for victim in victims[len(victims) - taken:]:
                    self.inject_revocation(run_id, victim.instance_id, notice_s)

        thread = threading.Thread(target=replay, daemon=True, name=f"trace-{run_id}")
        thread.start()
        return thread

    def first_notice(self, run_id: str) -> threading.Event:
        """Set when this provider gives the run its first revocation notice."""
        with self._lock:
            return self._first_notices.setdefault(run_id, threading.Event())

    def replay_capacity(self, run_id: str, instance_type: str, trace: CapacityTrace, time_scale: float,
                        notice_s: float, *, from_first_notice: bool = False,
                        started_s: float | None = None) -> threading.Thread:
        """Play a capacity trace against this run's spot instances of one type, `time_scale` trace
        seconds per real second, from now, from `started_s` (time.time(): a replay another process
        began) or from the run's first revocation notice, in a background thread (returned; it
        ends with the trace). See capacity_replay.py."""
        if instance_type not in self.types:
            raise UserInputError(f"unknown instance type {instance_type!r}; local offers {', '.join(self.types)}")
        start = self.first_notice(run_id) if from_first_notice else threading.Event()
        if not from_first_notice:
            start.set()
        return capacity_replay.play(self, run_id, instance_type, trace, time_scale, notice_s, start, self._stop_replays,
                                    started_s=started_s)

    # ------------------------------------------------------------ no leaks

    def kill_all_started(self) -> None:
        """Kill every process group this provider object started (atexit, signals)."""
        for timer in self._timers:
            timer.cancel()
        self._stop_replays.set()
        for started in list(self._first_notices.values()):
            started.set()  # a replay waiting for a notice sees the stop
        for pid, child in list(self._children.items()):
            _kill_group(pid, signal.SIGKILL)  # also what the instance started, if its leader is gone
            self._reap(pid)

    def stop_all_started(self) -> None:
        """SIGTERM every process group this provider object started, then kill_all_started once
        their leaders have exited or terminate_grace_s has passed: a PS told so writes a final
        checkpoint (a run resumed by its id loses nothing), a worker finishes its step and leaves.
        Asked again meanwhile (a second Ctrl-C), it kills at once."""
        if self._stopping:
            self.kill_all_started()
            return
        self._stopping = True
        children = list(self._children.values())
        for child in children:
            if child.poll() is None:
                _kill_group(child.pid, signal.SIGTERM)
        deadline_s = time.monotonic() + self.terminate_grace_s
        while time.monotonic() < deadline_s and any(child.poll() is None for child in children):
            time.sleep(0.05)
        self.kill_all_started()

    def _on_signal(self, signum, frame, previous) -> None:
        self.stop_all_started()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


class _KillOnSignal:
    """A provider's signal handler: kill what it started, then pass the signal on."""

    def __init__(self, provider: LocalProvider, previous) -> None:
        self.provider, self.previous = provider, previous

    def __call__(self, signum, frame) -> None:
        self.provider._on_signal(signum, frame, self.previous)


def _may_go_in_front_of(handler) -> bool:
    """Whether a provider's handler may replace `handler`, passing the signal on to it: Python's
    own (the default action, ignore, KeyboardInterrupt) or another provider's. A handler that other
    code installed stays in place: it turns the signal into an exception that unwinds the process
    through its cleanup (`finally`, atexit), and its owner may check that it is still installed.
    Prefect's flow engine installs one for SIGTERM, and its runner acknowledges a cancel only while
    it is in place; replaced, the cancel's SIGTERM would be recorded as a crash. An ignored signal
    (a background job's SIGINT) stays ignored: it stops nothing."""
    if handler is signal.SIG_IGN:
        return False
    return not callable(handler) or handler is signal.default_int_handler or isinstance(handler, _KillOnSignal)


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
