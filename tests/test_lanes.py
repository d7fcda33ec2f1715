"""The lanes hold (tests/README.md): a unit test that starts a process fails, one marked
integration may start one."""
import multiprocessing
import os
import subprocess

import pytest


def test_a_unit_test_that_starts_a_process_fails_with_a_clear_message():
    for start in (lambda: subprocess.run(["true"]), os.fork, multiprocessing.Process(target=print).start):
        with pytest.raises(pytest.fail.Exception, match="unit test started a process: mark it integration"):
            start()


@pytest.mark.integration
def test_an_integration_test_may_start_a_process():
    assert subprocess.run(["true"]).returncode == 0
