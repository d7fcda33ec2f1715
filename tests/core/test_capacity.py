import json

import numpy as np
import pytest

from tasks.core.capacity import load_capacity
from tasks.core.errors import UserInputError
from tests.helpers import REPO


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_plain_csv_is_a_step_function_in_seconds_from_its_first_row(tmp_path):
    trace = load_capacity(write(tmp_path, "p3-cap.csv", "# zone: us-east-1a\nseconds,available\n0,0\n10.5,4\n30,2\n60,2\n"))
    assert trace.family == "p3" and trace.zone == "us-east-1a" and trace.duration_s == 60
    assert [trace.at(t) for t in (0, 10, 10.5, 40, 61)] == [0, 0, 4, 2, 0]  # wraps after 60 s
    times, counts = trace.window(20, 60)
    assert times.tolist() == [0, 10, 40, 50.5] and counts.tolist() == [4, 2, 0, 4]


def test_json_counts_every_gap_with_the_zone_in_its_metadata(tmp_path):
    doc = {"metadata": {"gap_seconds": 600, "zone": "us-west-2b"}, "data": [2, 2, 0, 1]}
    trace = load_capacity(write(tmp_path, "g5.json", json.dumps(doc, indent=1)))
    assert trace.duration_s == 2400 and trace.zone == "us-west-2b"
    assert trace.times_s.tolist() == [0, 600, 1200, 1800] and trace.available.tolist() == [2, 2, 0, 1]
    trace.check_region("us-west-2")
    with pytest.raises(UserInputError, match=r"g5.json:4: zone us-west-2b is not in region us-east-1"):
        trace.check_region("us-east-1")


def test_a_bamboo_record_starts_at_its_first_live_instance_and_names_its_zone_by_file_name():
    path = REPO / "profiles/traces/bamboo_aws-spot-instances-g4dn-xlarge-us-east-1c-2020-11-20-1930-to-2020-11-21-2200.csv"
    trace = load_capacity(path)
    assert trace.family == "g4dn" and trace.zone == "us-east-1c" and trace.available[0] > 0
    assert np.all(np.diff(trace.times_s) > 0)
    with pytest.raises(UserInputError, match=r"\(its name\): zone us-east-1c is not in region eu-west-1"):
        trace.check_region("eu-west-1")


@pytest.mark.parametrize("name, text, message", [
    ("a.csv", "0,2\n10,-1\n20,0\n", r"a.csv:2: negative available count -1"),
    ("a.csv", "seconds,available\n0,2\n10,1\n5,0\n", r"a.csv:4: time goes backwards"),
    ("a.csv", "0,2\n10,1_0\n20,0\n", r"a.csv:2: available count is not an integer"),
    ("a.csv", "0,2\n1e400,1\n", r"a.csv:2: timestamp must be zero or more"),
    ("a.csv", "# zone: mars-1\n0,2\n10,1\n", r"a.csv:1: 'mars-1' is not an availability zone"),
    ("a.csv", "5,2\n", r"a.csv: the capacity trace spans no time"),
    ("a.csv", "", r"a.csv: capacity trace has no rows"),
    ("a.json", '{"metadata": {"gap_seconds": 0}, "data": [1]}', r"a.json:1: metadata.gap_seconds must be a positive"),
    ("a.json", '{"metadata": {"gap_seconds": 60},\n "data": [1,\n 2,\n -3]}', r"a.json:4: negative available count -3"),
    ("a.json", '{"metadata": {"gap_seconds": 60}, "data": [1, true]}', r"a.json:1: data\[1\] must be a whole count"),
    ("a.json", '{"metadata": {"gap_seconds": 60}, "data": []}', r"a.json: capacity trace has no data"),
])
def test_bad_records_are_one_line_naming_the_file_and_line(tmp_path, name, text, message):
    with pytest.raises(UserInputError, match=message):
        load_capacity(write(tmp_path, name, text))
