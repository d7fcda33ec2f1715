"""Property-based fuzzing of every command's parser and loaders (hypothesis): generated bad input
must give exit status 2, nothing on stdout, exactly one line on stderr, no traceback, and no file
written. The CLI's main() runs in-process, so a few hundred examples take seconds.

Classes of bad input covered (each test names its classes):
  1 counts/quotas/workers: malformed, negative, beyond int64, above the limit
  2 numbers: NaN, infinities, negative or zero durations, huge deadlines, non-numbers
  3 seeds, replays, batch sizes, parallelism: negative, zero, out of range
  4 identifiers escaping their folder: `--run-id ../x`, absolute ids, hidden names
  5 output paths: a folder, under a file, too long, read-only
  6 files that are not UTF-8
  7 JSON nested deeply
  8 integers beyond int64 and NaN/Infinity in JSON files
  9 truncated files: profiles, catalog sources, traces
 10 unknown regions and instance types
 11 malformed endpoint URLs
 12 workload options: NaN, infinities, negative sizes, unknown names
 13 unknown run ids for cleanup
 14 the newer options: probabilities (--confidence, --level), PS shards (--num-ps), profiling
    budgets, region lists, update rules, the filling bench's rate, type and bubble scale
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tasks.cli.main import main
from tests.helpers import SHIPPED_PROFILE, SOURCES

FUZZ = settings(max_examples=12, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PROFILE = str(SHIPPED_PROFILE)
PROFILE_TEXT = SHIPPED_PROFILE.read_text()
LOCAL_TYPE = json.loads(PROFILE_TEXT)["instances"][0]["type"]


@pytest.fixture(scope="module")
def sandbox():
    """A folder every example runs in (its cwd) and writes to if it wrongly writes anything."""
    root = Path(tempfile.mkdtemp(prefix="spotfill-fuzz-"))
    (root / "work").mkdir()
    (root / "inputs").mkdir()
    (root / "a-file").write_text("not a folder\n")
    previous = os.getcwd()
    os.chdir(root / "work")
    # Input that wrongly passes every check fails the test at once instead of starting a run.
    from tasks.cli import prefect_server
    from tasks.runtime import driver

    started = {"driver.start_run": driver.start_run, "temporary_server": prefect_server.temporary_server}

    def refuse_to_start(*args, **kwargs):
        raise AssertionError("bad input reached the start of a run")

    driver.start_run = prefect_server.temporary_server = refuse_to_start
    yield root
    driver.start_run, prefect_server.temporary_server = started["driver.start_run"], started["temporary_server"]
    os.chdir(previous)
    shutil.rmtree(root, ignore_errors=True)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "work").rglob("*")} | {
        str(p.relative_to(root)) for p in root.iterdir()}


def refuses(sandbox: Path, argv: list[str]) -> str:
    """Run the CLI; assert the bad-input contract; return the error line."""
    before = _tree(sandbox)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    text = err.getvalue()
    assert status == 2, (argv, status, text)
    assert out.getvalue() == "", (argv, out.getvalue())
    assert len(text.splitlines()) == 1 and text.endswith("\n"), (argv, text)
    assert "Traceback" not in text
    assert _tree(sandbox) == before, (argv, _tree(sandbox) ^ before)
    return text


# ----------------------------------------------------------------------------- value strategies
def _float_or_none(text):
    try:
        return float(text)
    except ValueError:
        return None


type_names = st.sampled_from([LOCAL_TYPE, "g3.8xlarge", "p3.2xlarge"])
huge_ints = st.integers(min_value=1001, max_value=10**40)
bad_count_items = st.one_of(
    st.builds(lambda t, n: f"{t}={n}", type_names, st.integers(max_value=-1)),          # negative
    st.builds(lambda t, n: f"{t}={n}", type_names, huge_ints),                          # above limit / int64
    st.builds(lambda t, x: f"{t}={x}", type_names, st.sampled_from(["nan", "1.5", "", "x", "1e3", "0x10"])),
    st.sampled_from(["=3", "p3.2xlarge", "p3.2xlarge==2", "p3.2xlarge=1,p3.2xlarge=1"]),
)
not_positive = st.one_of(
    st.sampled_from(["nan", "NaN", "inf", "-inf", "Infinity", "0", "-0", "", "abc", "1e400", "1,5", "0x10"]),
    st.floats(max_value=0, allow_nan=False).map(repr),
    st.text(alphabet=string.ascii_letters + "-_ ", min_size=1, max_size=12).filter(
        lambda t: _float_or_none(t) is None),
)
bad_durations = st.one_of(not_positive, st.floats(min_value=4e8, allow_infinity=False).map(repr))  # > ten years
bad_positive_ints = st.one_of(st.integers(max_value=0).map(str), st.integers(min_value=2**63).map(str),
                              st.sampled_from(["1.5", "nan", "", "two", "1e3"]))
bad_ids = st.one_of(
    st.sampled_from(["..", ".", "../x", "/abs", "/tmp/x", "a/b", ".hidden", "", "a" * 65, "x\x00y", "é"]),
    st.builds(lambda a: "../" + a, st.text(alphabet=string.ascii_letters, min_size=1, max_size=8)),
    st.text(alphabet="/\\:*?\"<>|\n\t ", min_size=1, max_size=5),
)
bad_regions = st.one_of(st.sampled_from(["mars-1", "US-EAST-1", "", " us-east-1", "us-east-1;rm"]),
                        st.text(alphabet=string.ascii_lowercase + "-", min_size=1, max_size=12).filter(
                            lambda r: r not in {"us-east-1", "us-west-2"}))
bad_urls = st.one_of(st.sampled_from(["http//x", "ftp://x", "://", "http://", "http://x:99999", "x", "",
                                      "http://[::1", "file:///etc/passwd"]),
                     st.text(alphabet=string.ascii_letters + ":/[]", min_size=1, max_size=15).filter(
                         lambda u: not u.startswith(("http://", "https://")) or "[" in u))


# ----------------------------------------------------------------------------- the parsers
@FUZZ
@given(item=bad_count_items)
def test_counts_plan_predict_train(sandbox, item):  # class 1
    refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--quota", item])
    refuses(sandbox, ["predict", PROFILE, "--loss", "0.8", "--cluster", item])
    refuses(sandbox, ["train", "--workload", "resnet20", "--workers", item, "--batch-size", "4"])


@FUZZ
@given(value=bad_durations)
def test_numbers_plan(sandbox, value):  # class 2
    refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", value])
    if _float_or_none(value) not in (0.0,):  # zero overhead is fine
        refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--overhead", value])
    if _float_or_none(value) is None or _float_or_none(value) <= 1.0:  # 0 < L <= gamma5: unreachable
        refuses(sandbox, ["plan", PROFILE, "--loss", value, "--deadline", "3000"])


@FUZZ
@given(duration=bad_durations, value=not_positive,
       option=st.sampled_from(["--timeout-s", "--checkpoint-every-s", "--notice-s"]))
def test_numbers_train(sandbox, duration, value, option):  # class 2
    train = ["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4"]
    refuses(sandbox, [*train, option, duration])
    refuses(sandbox, [*train, "--trace-time-scale", value])


@FUZZ
@given(duration=bad_durations, value=not_positive, option=st.sampled_from(["--time-scale", "--loss", "--risk-level"]))
def test_numbers_run(sandbox, duration, value, option):  # class 2: before any Prefect server starts
    refuses(sandbox, ["run", "--deadline", duration])
    refuses(sandbox, ["run", option, value])


@FUZZ
@given(seed=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32)).map(str),
       replays=bad_positive_ints)
def test_seeds_and_replays_simulate(sandbox, seed, replays):  # class 3
    refuses(sandbox, ["simulate", PROFILE, "--loss", "0.8", "--deadline", "3000", "--seed", seed])
    refuses(sandbox, ["simulate", PROFILE, "--loss", "0.8", "--deadline", "3000", "--replays", replays])


@FUZZ
@given(value=bad_positive_ints, option=st.sampled_from(["--parallel", "--repeats", "--iterations"]))
def test_parallelism_validate(sandbox, value, option):  # class 3
    refuses(sandbox, ["validate", "--quick", option, value])


@FUZZ
@given(value=st.one_of(bad_positive_ints, st.integers(min_value=65537, max_value=10**30).map(str)))
def test_batch_size_train(sandbox, value):  # class 3
    refuses(sandbox, ["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", value])


@FUZZ
@given(run_id=bad_ids)
def test_run_ids(sandbox, run_id):  # class 4
    refuses(sandbox, ["cleanup", "--run-id", run_id, "--provider", "local"])
    refuses(sandbox, ["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4",
                      "--run-id", run_id])


@FUZZ
@given(kind=st.sampled_from(["folder", "under-file", "too-long-name", "too-long-path"]),
       name=st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8))
def test_output_paths(sandbox, kind, name):  # class 5
    target = {"folder": str(sandbox / "inputs"), "under-file": str(sandbox / "a-file" / name),
              "too-long-name": str(sandbox / "work" / (name * 300)[:300]),
              "too-long-path": str(sandbox / "work" / "/".join([name] * 2100))}[kind]
    refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--out", target])
    if kind != "folder":
        refuses(sandbox, ["simulate", PROFILE, "--loss", "0.8", "--deadline", "3000", "--out-dir", target])
        refuses(sandbox, ["run", "--artifacts", target])
    refuses(sandbox, ["catalog", "build", "--out", target])


def test_an_output_path_that_is_a_link_or_a_device_is_refused_and_left_as_it_is(sandbox, tmp_path):  # class 5
    """The write replaces the path with a new file: as root, `--out /dev/null` would replace the
    device with a plain file."""
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    for target in (link, Path(os.devnull)):
        line = refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--out", str(target)])
        assert "not a regular file" in line
    assert link.is_symlink() and not (tmp_path / "elsewhere.json").exists()
    assert Path(os.devnull).is_char_device()


@pytest.mark.parametrize("argv, fragment", [
    (["predict", PROFILE, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=4", "--cluster", f"{LOCAL_TYPE}=1"],
     "--cluster given twice"),
    (["plan", PROFILE, "--loss=0.8", "--deadline", "3000", "--loss=0.9"], "--loss given twice"),
    (["predict", PROFILE, "--loss", "0_8", "--cluster", f"{LOCAL_TYPE}=1"], "not a number: '0_8'"),
    (["predict", PROFILE, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=1_0"], "is not an integer: '1_0'"),
    (["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "1_6"], "not an integer: '1_6'"),
    (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--dead", "600"], "unrecognized arguments: --dead 600"),
    (["predict", PROFILE, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=1", "--los", "9"], "unrecognized arguments: --los 9"),
    (["predict", PROFILE, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=\u0663"], "is not an integer"),
    (["predict", PROFILE, "--loss", "0.\uff18", "--cluster", f"{LOCAL_TYPE}=1"], "not a number"),
])
def test_a_repeated_or_abbreviated_option_or_a_digit_separator_is_refused_not_read_as_the_last_or_a_larger_number(
        sandbox, argv, fragment):
    assert fragment in refuses(sandbox, argv)


def test_options_that_collect_may_repeat(sandbox):
    """--workload-opt appends: given twice it is two values, not an error."""
    from tasks.cli.main import build_parser

    args = build_parser().parse_args(["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1",
                                      "--batch-size", "4", "--workload-opt", "width=2", "--workload-opt", "depth=8"])
    assert args.workload_opt == ["width=2", "depth=8"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(sandbox, tmp_path):  # class 5
    locked = sandbox / "locked"
    locked.mkdir(exist_ok=True)
    locked.chmod(0o500)
    try:
        refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--out", str(locked / "p.json")])
    finally:
        locked.chmod(0o700)
        locked.rmdir()


# ----------------------------------------------------------------------------- the loaders
def _put(sandbox: Path, name: str, data: bytes) -> str:
    path = sandbox / "inputs" / name
    path.write_bytes(data)
    return str(path)


def _profile_commands(path: str) -> list[list[str]]:
    return [["predict", path, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=1"],
            ["plan", path, "--loss", "0.8", "--deadline", "3000"],
            ["simulate", path, "--loss", "0.8", "--deadline", "3000", "--quick"]]


non_utf8 = st.binary(min_size=1, max_size=64).filter(lambda b: not _decodes(b))


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@FUZZ
@given(prefix=non_utf8, where=st.integers(min_value=0, max_value=len(PROFILE_TEXT)))
def test_non_utf8_files(sandbox, prefix, where):  # class 6
    raw = PROFILE_TEXT.encode()
    profile = _put(sandbox, "profile.json", raw[:where] + prefix + raw[where:])
    for argv in _profile_commands(profile):
        assert f"{profile} is not UTF-8" in refuses(sandbox, argv)  # the error names the file
    trace = _put(sandbox, "trace.csv", b"0,4\n10,2\n" + prefix)
    assert f"{trace} is not UTF-8" in refuses(sandbox, [
        "train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4", "--trace", trace])
    assert f"{trace} is not UTF-8" in refuses(sandbox, ["run", "--trace", trace])
    config = _put(sandbox, "aws.json", prefix)
    assert f"{config} is not UTF-8" in refuses(sandbox, ["cleanup", "--run-id", "r", "--provider", "aws",
                                                          "--config", config])


@FUZZ
@given(depth=st.integers(min_value=65, max_value=200_000), opener=st.sampled_from(["[", '{"a":']))
def test_deeply_nested_json(sandbox, depth, opener):  # class 7
    path = _put(sandbox, "deep.json", (opener * depth).encode())
    for argv in _profile_commands(path):
        refuses(sandbox, argv)
    refuses(sandbox, ["cleanup", "--run-id", "r", "--provider", "aws", "--config", path])


def _profile_fields(data, prefix=()):
    """(path, value) of every number in the profile."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _profile_fields(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _profile_fields(v, (*prefix, i))
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield prefix


NUMBER_FIELDS = list(_profile_fields(json.loads(PROFILE_TEXT)))
NUMBER_TYPES = {entry["type"] for entry in json.loads(PROFILE_TEXT)["instances"]}


@FUZZ
@given(field=st.sampled_from(NUMBER_FIELDS),
       bad=st.one_of(st.integers(min_value=2**63, max_value=10**40), st.integers(max_value=-(2**63) - 1),
                     st.sampled_from(["NaN", "Infinity", "-Infinity"])))
def test_json_numbers_out_of_range(sandbox, field, bad):  # class 8
    data = json.loads(PROFILE_TEXT)
    node = data
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = "__BAD__"
    path = _put(sandbox, "range.json", json.dumps(data).replace('"__BAD__"', str(bad)).encode())
    for argv in _profile_commands(path):
        refuses(sandbox, argv)


@FUZZ
@given(cut=st.integers(min_value=0, max_value=len(PROFILE_TEXT.rstrip()) - 1))
def test_truncated_profile(sandbox, cut):  # class 9
    path = _put(sandbox, "cut.json", PROFILE_TEXT.rstrip()[:cut].encode())
    for argv in _profile_commands(path):
        refuses(sandbox, argv)


@FUZZ
@given(text=st.one_of(st.just(""), st.sampled_from(["seconds,live\n", "0,4\n", "0,4\nx,y\n", "0,-1\n5,2\n",
                                                    "1,add\n", "0,nan\n1,2\n", "0,4\n1e400,2\n"]),
                      st.text(alphabet="0123456789,.-\nabc", max_size=30)))
def test_truncated_or_garbage_traces(sandbox, text):  # class 9
    from tasks.core.errors import UserInputError
    from tasks.core.traces import load_trace

    path = _put(sandbox, "t.csv", text.encode())
    try:
        load_trace(path)
    except UserInputError:
        pass
    else:
        assume(False)  # a valid trace by chance: not this test's business
    refuses(sandbox, ["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4",
                      "--trace", path])


CATALOG_SOURCES = ["ec2-gpu-instances.json", "spot-advisor-data.json", "spot-prices-gpu-2022-05-31.tsv"]


@pytest.fixture(scope="module")
def catalog_sources(sandbox):
    sources = sandbox / "inputs" / "sources"
    shutil.copytree(SOURCES, sources)
    return sources


@settings(FUZZ, max_examples=4)
@given(victim=st.sampled_from(CATALOG_SOURCES), fraction=st.floats(min_value=0.0, max_value=0.99))
def test_truncated_catalog_sources(sandbox, catalog_sources, victim, fraction):  # class 9
    original = (SOURCES / victim).read_bytes()
    (catalog_sources / victim).write_bytes(original[:int(len(original) * fraction)])
    try:
        refuses(sandbox, ["catalog", "build", "--sources", str(catalog_sources),
                          "--out", str(sandbox / "inputs" / "c.json")])
    finally:
        (catalog_sources / victim).write_bytes(original)
    assert not (sandbox / "inputs" / "c.json").exists()


@FUZZ
@given(region=bad_regions, instance_type=st.text(alphabet=string.ascii_lowercase + "0123456789.", min_size=1,
                                                 max_size=12).filter(lambda t: t not in {LOCAL_TYPE, "g3.8xlarge"}))
def test_unknown_regions_and_types(sandbox, region, instance_type):  # class 10
    refuses(sandbox, ["catalog", "show", "--region", region])
    refuses(sandbox, ["simulate", PROFILE, "--loss", "0.8", "--deadline", "3000", "--region", region])
    refuses(sandbox, ["run", "--region", region])
    refuses(sandbox, ["run", "--types", instance_type])
    refuses(sandbox, ["train", "--workload", "resnet20", "--workers", f"{instance_type}=1", "--batch-size", "4"])
    refuses(sandbox, ["predict", PROFILE, "--loss", "0.8", "--cluster", f"{instance_type}=1"])


@FUZZ
@given(url=bad_urls)
def test_malformed_endpoint_urls(sandbox, url):  # class 11
    refuses(sandbox, ["cleanup", "--run-id", "r", "--provider", "aws", "--region", "us-east-1", "--endpoint-url", url])


@FUZZ
@given(option=st.one_of(
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["width", "noise"]), st.sampled_from(["nan", "inf", "-inf"])),
    st.builds(lambda v: f"width={v}", st.integers(max_value=0)),
    st.builds(lambda v: f"width={v}", st.integers(min_value=2**31)),
    st.builds(lambda k: f"{k}=1", st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6).filter(
        lambda k: k not in {"width", "noise", "depth"})),
    st.sampled_from(["width", "=3", "1x=2", "width==2"]),
))
def test_workload_options(sandbox, option):  # class 12
    refuses(sandbox, ["train", "--workload", "resnet20", "--workload-opt", option, "--workers", f"{LOCAL_TYPE}=1",
                      "--batch-size", "4"])
    refuses(sandbox, ["run", "--workload", "resnet20", "--workload-opt", option])


@FUZZ
@given(run_id=st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=20))
def test_cleanup_of_an_unknown_run(sandbox, run_id):  # class 13
    assert run_id in refuses(sandbox, ["cleanup", "--run-id", run_id, "--provider", "local"])
    refuses(sandbox, ["cleanup", "--run-id", run_id, "--provider", "local", "--artifacts", str(sandbox / "work")])


not_a_probability = st.one_of(not_positive, st.floats(min_value=1.0).map(repr),
                              st.sampled_from(["1", "1e-400", "-0.5", "100"]))
bad_region_lists = st.one_of(bad_regions, st.sampled_from(["", ",", "us-east-1,,", "us-east-1,us-east-1",
                                                           "all,us-east-1", " , "]))


@FUZZ
@given(probability=not_a_probability, shards=st.one_of(bad_positive_ints, st.integers(16, 10**30).map(str)),
       budget=bad_durations, regions=bad_region_lists,
       rule=st.text(alphabet=string.ascii_letters, max_size=8).filter(lambda r: r not in {"momentum", "sqrt", "inverse"}))
def test_newer_options(sandbox, probability, shards, budget, regions, rule):  # class 14
    train = ["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4"]
    refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--confidence", probability])
    refuses(sandbox, ["predict", PROFILE, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=1", "--level", probability])
    refuses(sandbox, ["simulate", PROFILE, "--loss", "0.8", "--deadline", "3000", "--quick", "--level", probability])
    refuses(sandbox, ["run", "--confidence", probability])
    refuses(sandbox, [*train, "--num-ps", shards])
    refuses(sandbox, ["run", "--profile-budget-s", budget])
    refuses(sandbox, ["profile", "--quick", "--profile-budget-s", budget])
    refuses(sandbox, ["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--regions", regions])
    refuses(sandbox, [*train, "--async-rule", rule])
    refuses(sandbox, ["run", "--async-rule", rule])


@FUZZ
@given(rate=st.one_of(not_positive.filter(lambda r: "," not in r),  # "1,5" is a list of two rates
                     st.floats(min_value=1001, allow_infinity=False).map(repr)),
       scale=st.one_of(not_positive, st.floats(min_value=1001, allow_infinity=False).map(repr)),
       instance_type=st.text(alphabet=string.ascii_lowercase + "0123456789.,/", max_size=12).filter(
           lambda t: t not in NUMBER_TYPES))
def test_newer_bench_options(sandbox, rate, scale, instance_type):  # class 14
    refuses(sandbox, ["bench", "filling", "--quick", "--online-rate", rate])
    refuses(sandbox, ["bench", "filling", "--quick", "--bubble-scale", scale])
    refuses(sandbox, ["bench", "filling", "--quick", "--instance-type", instance_type])
    refuses(sandbox, ["bench", "planner", "--quick", "--bubble-scale", "2"])  # a filling-only option


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="with a CUDA device `bench gpu` runs")
def test_bench_gpu_without_cuda(sandbox):  # class 14
    assert "CUDA" in refuses(sandbox, ["bench", "gpu", "--quick"])


@pytest.mark.parametrize("name, value", [("SPOTFILL_MAX_COUNT", "2000 "), ("SPOTFILL_MAX_COUNT", "1e4"),
                                         ("SPOTFILL_MAX_LOCAL_WORKERS", "-5"), ("SPOTFILL_MAX_PARAMS", "abc")])
def test_a_limit_variable_that_is_not_a_whole_number_is_refused_not_ignored(sandbox, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    argv = (["plan", PROFILE, "--loss", "0.8", "--deadline", "3000", "--quota", f"{LOCAL_TYPE}=2"]
            if name == "SPOTFILL_MAX_COUNT" else
            ["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4"])
    assert f"{name} must be a positive whole number, got {value!r}" in refuses(sandbox, argv)


def test_an_input_that_is_not_a_regular_file_or_is_ambiguous_json_is_one_line(sandbox, tmp_path):
    """A FIFO would block the read, /dev/zero fill the memory; a key given twice or an integer of
    thousands of digits would be read some way without a word."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    profile = json.loads(PROFILE_TEXT)
    cases = [(str(fifo), "is not a regular file"), (os.devnull, "is not a regular file"),
             ("/dev/zero", "is not a regular file"), (str(tmp_path), "is not a regular file")]
    twice = tmp_path / "twice.json"
    twice.write_text(PROFILE_TEXT.replace('"param_mb":', '"param_mb": -5, "param_mb":', 1))
    digits = tmp_path / "digits.json"
    digits.write_text(json.dumps({**profile, "num_ps": 1}).replace('"num_ps": 1', '"num_ps": ' + "9" * 5000))
    quota = tmp_path / "quota.json"
    quota.write_text(json.dumps({**profile, "instances": [{**profile["instances"][0], "quota": 10**9}]}))
    cases += [(str(twice), "key 'param_mb' is given twice in one object"), (str(digits), "is beyond int64"),
              (str(quota), "quota 1000000000 is more than 1000 (SPOTFILL_MAX_COUNT")]
    for path, fragment in cases:
        assert fragment in refuses(sandbox, ["predict", path, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=1"]), path
    assert "is not a regular file" in refuses(sandbox, ["simulate", PROFILE, "--loss", "0.8", "--deadline", "3000",
                                                        "--traces", str(fifo)])


def test_a_target_the_curve_starts_below_is_refused_not_answered_with_zero_seconds(sandbox):
    """Every cluster reaches such a target before its first update: $0 plans, all tied."""
    assert "at or above where the fitted loss curve starts" in refuses(
        sandbox, ["predict", PROFILE, "--loss", "5", "--cluster", f"{LOCAL_TYPE}=1"])
    assert "the model needs no update to reach it" in refuses(sandbox, ["plan", PROFILE, "--loss", "5", "--deadline", "3600"])


@pytest.mark.parametrize("argv, fragment", [
    (["predict", PROFILE, "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=1", "--level", "0.5"],
     "has no uncertainty.time_log_sd"),
    (["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4", "--notice-s", "3"],
     "--notice-s sets how a trace is replayed, but no --trace is given"),
    (["train", "--workload", "resnet20", "--workers", f"{LOCAL_TYPE}=1", "--batch-size", "4", "--trace-time-scale", "9"],
     "--trace-time-scale sets how a trace is replayed"),
    (["validate", "--profile", PROFILE, "--iterations", "5"], "--iterations sets how to profile, but --profile"),
    (["run", "--risk-level", "0.9"], "risk_level 0.9 is used by solver 'risk' only"),
])
def test_an_option_that_would_do_nothing_is_refused_not_ignored(sandbox, argv, fragment):
    assert fragment in refuses(sandbox, argv)


def test_plan_does_not_write_its_plan_over_the_profile_it_reads(sandbox, tmp_path):
    copy = tmp_path / "profile.json"
    copy.write_text(PROFILE_TEXT)
    assert "is the profile this plan reads" in refuses(
        sandbox, ["plan", str(copy), "--loss", "0.8", "--deadline", "3000", "--out", str(copy)])
    assert copy.read_text() == PROFILE_TEXT


def test_a_level_too_close_to_1_for_an_interval_is_named(sandbox, tmp_path):
    spread = tmp_path / "spread.json"
    spread.write_text(json.dumps({**json.loads(PROFILE_TEXT), "uncertainty": {"time_log_sd": 0.1}}))
    level = "0.9999999999999999"  # below 1, but (1 + level) / 2 is 1.0 in floats
    assert "--level 0.9999999999999999 is too close to 1" in refuses(
        sandbox, ["predict", str(spread), "--loss", "0.8", "--cluster", f"{LOCAL_TYPE}=1", "--level", level])
    assert "confidence 0.9999999999999999 is too close to 1" in refuses(
        sandbox, ["plan", str(spread), "--loss", "0.8", "--deadline", "3000", "--confidence", level])
