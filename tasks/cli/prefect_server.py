"""The temporary Prefect server of `spotfill run`, owned by this process from start to stop.

Prefect's own ephemeral server is started in the CLI's process group, so Ctrl-C in a terminal
killed it first and the flow then retried the dead API for minutes; after SIGTERM or SIGKILL it
was left running. This one is started in its own process group (a terminal's Ctrl-C does not reach
it), through tasks.core.lifeline (the kernel kills it if this process dies, even by SIGKILL), and it is
stopped when the `with` block ends, however it ends. With PREFECT_API_URL set, the server named
there is used and nothing is started.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from tasks.core.lifeline import tied_to_this_process

STOP_GRACE_S = 3.0  # an ephemeral SQLite server: a quick SIGKILL loses nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after STOP_GRACE_S, then reap."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _drain_prefect_clients(timeout_s: float = 5.0) -> None:
    """Send the logs and events Prefect still queues while the server is up: left for Prefect's
    own exit hook, they would be retried against a stopped server for over a minute."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=timeout_s)


@contextlib.contextmanager
def temporary_server(log_path: Path, startup_timeout_s: float = 180.0) -> Iterator[str | None]:
    """Start a Prefect server on a free local port, point PREFECT_API_URL at it for the block, and
    stop it afterwards; yields its API URL (None when PREFECT_API_URL was set already). Call it
    before anything imports prefect: Prefect reads its settings at import."""
    if os.environ.get("PREFECT_API_URL") or "prefect" in sys.modules:  # a server chosen already
        yield None
        return
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    argv = tied_to_this_process([sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
                                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   process_group=0, cwd=Path(__file__).resolve().parents[2])
    try:
        started_s = time.monotonic()
        while not _healthy(api_url):
            if process.poll() is not None:
                raise RuntimeError(f"the temporary Prefect server exited with status {process.returncode}; "
                                   f"see {log_path}")
            if time.monotonic() - started_s > startup_timeout_s:
                raise RuntimeError(f"the temporary Prefect server did not answer within {startup_timeout_s:g} s; "
                                   f"see {log_path}")
            time.sleep(0.2)
        os.environ["PREFECT_API_URL"] = api_url
        yield api_url
    finally:
        _drain_prefect_clients()
        os.environ.pop("PREFECT_API_URL", None)
        stop(process)
