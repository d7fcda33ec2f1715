"""What one thread prints, captured while the process's other threads keep printing where they
did: `contextlib.redirect_stdout` swaps the process-wide sys.stdout, so two threads entering and
leaving it interleaved (profiling tasks in Prefect's thread pool) leave sys.stdout a stray buffer
and `--json` output lost. Here sys.stdout and sys.stderr are wrapped, while any thread captures,
in a proxy that sends a capturing thread's writes to its buffer and every other write on."""
from __future__ import annotations

import contextlib
import io
import sys
import threading
from typing import Iterator, TextIO

_lock = threading.Lock()
_local = threading.local()  # .buffer: the capturing thread's StringIO
_capturing = 0  # threads inside captured_output(), under _lock


class _ThreadRouted:
    """A stream that writes to the current thread's capture buffer, if any, else to the stream it wraps."""

    def __init__(self, wrapped: TextIO):
        self.wrapped = wrapped

    def _target(self) -> TextIO:
        buffer = getattr(_local, "buffer", None)
        return self.wrapped if buffer is None else buffer

    def write(self, text: str) -> int:
        return self._target().write(text)

    def writelines(self, lines) -> None:
        self._target().writelines(lines)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, name: str):  # encoding, fileno, isatty, buffer: the real stream's
        return getattr(self.wrapped, name)


def _install() -> None:
    sys.stdout, sys.stderr = _ThreadRouted(sys.stdout), _ThreadRouted(sys.stderr)


def _uninstall() -> None:
    """Unwrap the streams that are still ours (one replaced since stays as its replacer left it)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _ThreadRouted):
            setattr(sys, name, stream.wrapped)


@contextlib.contextmanager
def captured_output() -> Iterator[io.StringIO]:
    """What this thread writes to sys.stdout or sys.stderr inside the block, in one buffer; other
    threads' output is untouched, and the streams are the process's own again once no thread captures."""
    global _capturing
    with _lock:
        if _capturing == 0:
            _install()
        _capturing += 1
    previous = getattr(_local, "buffer", None)
    _local.buffer = printed = io.StringIO()
    try:
        yield printed
    finally:
        _local.buffer = previous
        with _lock:
            _capturing -= 1
            if _capturing == 0:
                _uninstall()
