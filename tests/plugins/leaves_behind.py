"""A valid plug-in whose build() leaves things running, as a careless user's may: a non-daemon
thread (which would keep a process from exiting) and a helper process. Each process that builds
it records its helper's pid in the folder named by SPOTFILL_TEST_PID_DIR, a file named by the
helper's pid holding the builder's (tests/cli/test_train_leftovers.py and
tests/runtime/test_lease_runs.py check that none outlives the run)."""
import os
import subprocess
import threading
from pathlib import Path

from tests.plugins.regression import build as regression

_forever = threading.Event()


def build():
    threading.Thread(target=_forever.wait, name="never-ends").start()
    helper = subprocess.Popen(["sleep", "100000"])
    Path(os.environ["SPOTFILL_TEST_PID_DIR"], str(helper.pid)).write_text(str(os.getpid()))
    return regression()
