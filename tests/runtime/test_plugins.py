"""Plug-ins of a user's kind (tests/plugins/): the contract (docs/plugins.md), its checks before
anything starts, and asynchronous training of untuned models on mixed workers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tasks.core.errors import UserInputError
from tasks.runtime.workloads import Workload, build_workload, check_workload
from tests.helpers import REPO

PLUGINS = ["regression", "classifier", "recurrent", "adam_cnn"]


@pytest.mark.parametrize("name", PLUGINS)
def test_user_plugins_pass_the_checks_and_learn_alone(name):
    workload = check_workload(f"tests.plugins.{name}:build")
    assert isinstance(workload, Workload)
    steps = workload.plain_steps(32)
    first = [next(steps) for _ in range(10)]
    for _ in range(200):  # Adam at 1e-3 leaves its plateau after about 100 steps
        next(steps)
    last = [next(steps) for _ in range(10)]
    assert sum(last) < 0.9 * sum(first)


def test_tuple_plugins_get_the_stated_defaults():
    workload = check_workload("tests.plugins.regression:build")
    assert (workload.optimizer, workload.base_lr, workload.base_batch) == ("sgd", 0.05, 128)
    assert check_workload("tests.plugins.adam_cnn:build").optimizer == "adam"


@pytest.mark.parametrize("spec,message", [
    ("tests.plugins.nowhere:build", "cannot import 'tests.plugins.nowhere'"),
    ("tests.plugins.broken:missing", "has no function 'missing'"),
    ("tests.plugins.broken:not_a_tuple", "returned int; expected (model, batches, loss_fn) or a Workload"),
    ("tests.plugins.broken:two_items", "returned a tuple of 2 items"),
    ("tests.plugins.broken:not_a_model", "the model is a str, not a torch.nn.Module"),
    ("tests.plugins.broken:not_a_batch_source", "batches is a list, not callable"),
    ("tests.plugins.broken:yields_bare_tensors", "must yield (inputs, targets) tensor pairs"),
    ("tests.plugins.broken:nan_loss", "the loss of the first batch is nan"),
    ("tests.plugins.broken:shape_mismatch", "loss_fn(model(inputs), targets) failed: RuntimeError"),
    ("tests.plugins.broken:raises", "failed while building: RuntimeError: dataset not found"),
    ("tests.plugins.broken:exits", "called sys.exit('the plug-in gave up') while building"),
    ("tests.plugins.broken:exits_hard", "called os._exit(0) while building"),
    ("tests.plugins.broken:exits_hard_in_its_batches", "called os._exit(3) while training one step: no data here"),
    # parameters of another type would be made float32 by the runtime, and training fail on mixed types
    ("tests.plugins.broken:bf16_model", "0.weight is bfloat16; the runtime trains float32 parameters"),
    ("tests.plugins.broken:fp16_model", "0.weight is float16; the runtime trains float32 parameters"),
    ("tests.plugins.broken:fp64_model", "0.weight is float64; the runtime trains float32 parameters"),
    ("tests.plugins.broken:batches_not_iterable", "batches(batch_size, seed) returned a value of type int, not an iterable"),
    ("tests.plugins.parses_argv:build",
     "called sys.exit(2) while being imported: train.py: error: the following arguments are required: --data"),
])
def test_bad_plugins_are_one_line_exit_2_and_nothing_launched(spec, message, tmp_path, capsys, monkeypatch):
    from tasks.cli.main import main
    from tasks.providers.local import LocalProvider

    launched = []
    monkeypatch.setattr(LocalProvider, "launch", lambda *a, **k: launched.append(a))
    for argv in (["train", "--workers", "p3.2xlarge=1", "--batch-size", "8", "--max-updates", "5"],
                 ["run", "--loss", "0.1", "--deadline", "120", "--artifacts", str(tmp_path)]):
        status = main([*argv, "--workload", spec])
        out, err = capsys.readouterr()
        assert status == 2 and out == "" and launched == [], argv[0]
        assert err.startswith("spotfill: error: ") and message in err, argv[0]
        assert len(err.strip().splitlines()) == 1 and err.count(spec) == 1, argv[0]  # said once, not nested
    assert not any(tmp_path.iterdir())  # `run` made no run folder: it stopped before starting anything
    with pytest.raises(UserInputError, match="workload"):
        check_workload(spec)


def test_batches_given_as_any_iterable_serve_every_consumer():
    """A list of batches passes the one-step check and then feeds plain training and profiling's
    memory measurement, each of which takes the next batch."""
    from tasks.profiling.memory import measure_memory

    workload = check_workload("tests.plugins.listed_batches:build")
    steps = workload.plain_steps(4)
    assert all(loss >= 0 for loss in (next(steps) for _ in range(3)))
    device, points = measure_memory("tests.plugins.listed_batches:build", {}, [2, 4], device="cpu")
    assert device == "cpu" and points[1].peak_bytes > points[0].peak_bytes


def test_os_exit_outside_plugin_code_still_ends_a_thread_of_its_own():
    """The guard against a plug-in's os._exit is this thread's, inside its code only: once the
    check is done, os._exit is Python's own again."""
    with pytest.raises(UserInputError, match=r"os._exit\(0\)"):
        build_workload("tests.plugins.broken:exits_hard")
    assert os._exit.__module__ == "posix"


def _doc_example(marker: str = "plugin-example") -> str:
    text = (REPO / "docs" / "plugins.md").read_text()
    block = text.split(f"<!-- {marker} -->", 1)[1]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("marker,plugin", [("plugin-example", "regression.py"), ("evaluated-example", "evaluated.py")])
def test_the_guide_examples_are_the_tested_plugins(marker, plugin):
    assert _doc_example(marker) == (REPO / "tests" / "plugins" / plugin).read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_the_guide_example_trains_on_mixed_workers_from_a_folder_outside_the_repository(tmp_path):
    """As a user runs it: my_model.py in their own folder, the console script started there; the
    parameter server and workers run in the repository folder and still find the module and the
    run directory."""
    (tmp_path / "my_model.py").write_text(_doc_example())
    spotfill = Path(sys.executable).with_name("spotfill")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(spotfill), "train", "--workload", "my_model:build", "--workers",
                           "p3.2xlarge=2,g3.8xlarge=1", "--batch-size", "32", "--max-updates", "300", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["updates"] >= 300 and result["stopped"] == "max_updates"
    # from about 11 (the targets' variance is 16): trained, whatever staleness a loaded machine gives
    # the asynchronous updates (1.39 after 300 updates with a busy loop on one of two cores)
    assert result["smoothed_loss"] < 3.0


def test_a_plugin_that_prints_and_reads_tensor_values_passes_the_checks_with_stdout_left_alone(capsys):
    """stdout is for --json's one object: a plug-in's prints go to stderr; and a builder that reads a
    value (.item()) is built for real where the meta-device size check cannot run it."""
    from tasks.runtime.workloads import check_workload as check_before_start

    check_before_start("tests.plugins.broken:talks_and_reads_its_data", {})
    out, err = capsys.readouterr()
    assert out == "" and "building my model..." in err


@pytest.mark.integration
def test_training_whose_workers_all_exit_ends_at_once_with_exit_1_and_the_workers_last_words(tmp_path, capsys):
    """A worker whose batches run out dies; with none left the run cannot go on: `train` ends
    without waiting out --timeout-s, says why in one line and exits 1 (not 0, 'stopped by stop_file')."""
    from tasks.cli.main import main

    status = main(["train", "--workload", "tests.plugins.broken:runs_out", "--workers", "p3.2xlarge=1",
                   "--batch-size", "8", "--max-updates", "50", "--timeout-s", "600", "--json",
                   "--artifacts", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 1 and json.loads(out)["stopped"] == "workers_gone"
    (line,) = [line for line in err.splitlines() if line.startswith("spotfill: ")]
    assert "every worker exited" in line and "batches ran out after 2 steps" in line


def test_plugins_built_in_threads_at_once_leave_the_process_streams_as_they_were(capsys):
    """Two profiling tasks build their plug-ins in Prefect's thread pool: one enters the plug-in's
    code, the other enters while it is inside, the first leaves, then the second. What each
    prints goes to stderr, and sys.stdout (where `--json` writes) is the same stream after."""
    from tests.plugins.waits import EVENTS

    stdout, stderr = sys.stdout, sys.stderr
    spec = "tests.plugins.waits:build"
    errors = []

    def build(**options):
        try:
            build_workload(spec, options)
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    first = threading.Thread(target=build, kwargs={"name": "first", "set_on_entry": "first-in", "wait_for": "second-in"})
    second = threading.Thread(target=build, kwargs={"name": "second", "set_on_entry": "second-in", "wait_for": "first-out"})
    first.start()
    assert EVENTS["first-in"].wait(60)
    second.start()
    first.join(60)
    EVENTS["first-out"].set()
    second.join(60)
    assert not errors and not first.is_alive() and not second.is_alive()
    assert sys.stdout is stdout and sys.stderr is stderr
    print("after")
    out, err = capsys.readouterr()
    assert out == "after\n" and "first building" in err and "second building" in err
