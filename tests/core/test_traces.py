"""Trace parsing, bad traces, and the per-type hazards derived from traces and bands."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from tasks.core.errors import UserInputError
from tasks.core.profile import load_profile
from tasks.core.traces import family_of, load_trace, load_traces
from tasks.market.hazards import band_hazard_per_h, stress_factor, type_hazards
from tests.helpers import SHIPPED_PROFILE


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_traces_parse_with_their_families():
    traces = {t.name: t for t in load_traces()}
    assert len(traces) == 5
    parcae = traces["parcae_p3trace"]
    assert parcae.family == "p3"
    assert parcae.revocations == 167  # the file's remove rows
    assert parcae.duration_s == pytest.approx(40_920.0)
    p2 = traces["bamboo_aws-spot-instances-p2-xlarge-2020-11-20-to-2020-11-23"]
    assert p2.family == "p2"
    assert p2.duration_s == pytest.approx(88.695 * 3600)  # decimal timestamps are hours
    g4dn = next(t for n, t in traces.items() if "g4dn-xlarge-us-east-1c" in n)
    assert g4dn.family == "g4dn" and g4dn.live_from_s == 21529.0  # no instance before then
    for t in traces.values():
        assert 0 < t.revoked_fraction.min() and t.revoked_fraction.max() <= 1
        assert (t.event_times_s[1:] > t.event_times_s[:-1]).all()


def test_steps_to_events(tmp_path):
    t = load_trace(write(tmp_path, "bamboo_aws-spot-instances-p3-2xlarge-x.csv",
                         "0,4\n100,4\n100,2\n200,2\n200,3\n300,3\n300,0\n"))
    assert t.family == "p3"
    assert t.event_times_s.tolist() == [100.0, 300.0]
    assert t.revoked_fraction.tolist() == [0.5, 1.0]
    assert t.revocations == 5
    assert t.instance_hours == pytest.approx((4 * 100 + 2 * 100 + 3 * 100) / 3600)


def test_simultaneous_removes_are_one_event(tmp_path):
    t = load_trace(write(tmp_path, "parcae_p3trace.csv",
                         "0,add,a\n0,add,b\n0,add,c\n0,add,d\n1000,remove,a\n1000,remove,b\n2000,remove,c\n"))
    assert t.event_times_s.tolist() == [1.0, 2.0]
    assert t.revoked_fraction.tolist() == [0.5, 0.5]
    assert t.revocations == 3


@pytest.mark.parametrize("text, message", [
    ("", "trace has no events"),
    ("\n\n", "trace has no events"),
    ("0,2\n-5,1\n", ":2: negative timestamp -5"),
    ("0,2\n50,2\n40,1\n", ":3: time goes backwards"),
    ("0,2\n10,x\n", ":2: live instance count is not an integer"),
    ("0,2\n10,-1\n", ":2: negative live instance count"),
    ("0,add,a\n5,remove,b\n", ":2: remove of 'b', which is not live"),
    ("0,add,a\n5,drop,a\n", ":2: unknown event 'drop'"),
    ("0,1,2,3\n", ":1: unknown trace format"),
    ("0,2\n5,add,a\n", "unknown trace format"),
    ("0,0\n100,0\n", "no instance is ever live"),
    ("0,2\n1.0e306,1\n", ":2: timestamp 1.0e306 is more than ten years (in hours: it has a dot)"),
    ("0,add,a\n1e30,remove,a\n", ":2: timestamp 1e30 ms is more than ten years"),
    ("0,2\n1e-320,1\n", "the trace spans 1e-320 s with instances live"),
    # digit separators and other scripts' digits are typos, not other numbers (1000, 12, 10)
    ("0,2\n1_000,1\n", ":2: timestamp is not a number: 1_000"),
    ("0,2\n\u0661\u0662,1\n", ":2: timestamp is not a number: \u0661\u0662"),
    ("0,1_0\n100,2\n", ":1: live instance count is not an integer: 1_0"),
    ("0,2\n10,\uff11\n", ":2: live instance count is not an integer"),
    ("0,2\n1,000,1\n", ":2: unknown trace format"),
    ("0,2\n10," + "x" * 4000 + "\n", "is not an integer: " + "x" * 120 + "... (4000 characters)"),
])
def test_bad_traces_are_one_line_errors_naming_file_and_line(tmp_path, text, message):
    path = write(tmp_path, "parcae_p3trace.csv", text)
    with pytest.raises(UserInputError) as err:
        load_trace(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_trace_file_and_unknown_family(tmp_path):
    with pytest.raises(UserInputError, match="trace not found"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(UserInputError, match="instance family"):
        family_of("mystery")
    assert family_of("p3-my-own-trace") == "p3" and family_of("parcae_p3trace") == "p3"


def test_band_hazard_is_the_monthly_midpoint_as_a_constant_hazard():
    assert band_hazard_per_h(4) == pytest.approx(-math.log(0.75) / 730)
    assert band_hazard_per_h(0) == pytest.approx(-math.log(0.975) / 730)
    rates = [band_hazard_per_h(b) for b in range(5)]
    assert rates == sorted(rates) and rates[0] > 0
    # A month at the hazard gives back the band's midpoint.
    assert 1 - math.exp(-band_hazard_per_h(2) * 730) == pytest.approx(0.125)
    with pytest.raises(UserInputError, match="0..4"):
        band_hazard_per_h(5)


def test_type_hazards_map_by_family_and_band():
    profile = load_profile(SHIPPED_PROFILE)
    traces = load_traces()
    bands = {"p3.2xlarge": 4, "g4dn.4xlarge": 4, "p2.8xlarge": 4, "g3.8xlarge": 3, "g3.16xlarge": 4}
    table, stress = type_hazards(profile, traces, bands)
    assert table["p3.2xlarge"].source == "trace"
    assert [t.family for t in table["g4dn.4xlarge"].traces] == ["g4dn", "g4dn"]
    assert table["p3.2xlarge"].hazard_per_h == pytest.approx(167 / table["p3.2xlarge"].traces[0].instance_hours)
    assert table["g3.8xlarge"].source == "band"
    assert table["g3.8xlarge"].hazard_per_h == pytest.approx(band_hazard_per_h(3) * stress)
    mapped = {k: v.traces for k, v in table.items() if v.traces}
    assert stress == pytest.approx(stress_factor({k: list(v) for k, v in mapped.items()}, bands))
    assert stress > 100  # the traces come from far stormier days than a monthly average
    fixed, s = type_hazards(profile, traces, bands, stress=2.0)
    assert s == 2.0 and fixed["g3.16xlarge"].hazard_per_h == pytest.approx(2 * band_hazard_per_h(4))


def test_type_without_trace_or_band_is_a_clear_error_unless_unused():
    profile = load_profile(SHIPPED_PROFILE)
    with pytest.raises(UserInputError, match=r"g3.8xlarge has no trace of its family \(g3\) and no interruption band"):
        type_hazards(profile, load_traces(), {"p3.2xlarge": 4})
    unused = profile.model_copy(update={"instances": [
        i.model_copy(update={"quota": 0 if i.type.startswith("g3") else i.quota}) for i in profile.instances]})
    table, _ = type_hazards(unused, load_traces(), {"p3.2xlarge": 4})
    assert table["g3.8xlarge"].hazard_per_h == 0 and table["g3.8xlarge"].source == "unused"


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 500), st.integers(0, 20)), min_size=1, max_size=30))
def test_step_traces_count_every_decrease(tmp_path_factory, steps):
    live = [20] + [n for _, n in steps]
    times = [0]
    for dt, _ in steps:
        times.append(times[-1] + dt)
    text = "".join(f"{t},{n}\n" for t, n in zip(times, live))
    path = tmp_path_factory.mktemp("t") / "bamboo_aws-spot-instances-p2-xlarge-h.csv"
    path.write_text(text)
    trace = load_trace(path)
    assert trace.revocations == sum(max(0, a - b) for a, b in zip(live, live[1:]))
    assert len(trace.event_times_s) == sum(b < a for a, b in zip(live, live[1:]))
    assert trace.instance_hours == pytest.approx(sum(a * (t1 - t0) for a, t0, t1 in zip(live, times, times[1:])) / 3600)

