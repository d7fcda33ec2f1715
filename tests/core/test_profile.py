import json

import pytest

from tasks.core.errors import UserInputError
from tasks.core.profile import load_profile, profile_from_dict
from tests.helpers import SHIPPED_PROFILE


def shipped() -> dict:
    return json.loads(SHIPPED_PROFILE.read_text())


def test_shipped_profile_loads():
    p = load_profile(SHIPPED_PROFILE)
    assert p.type_names == ["p3.2xlarge", "g4dn.4xlarge", "g3.8xlarge", "g3.16xlarge", "p2.8xlarge"]
    assert p.loss.gamma4 is None
    assert p.instance("g3.8xlarge").gpus == 2


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d.pop("param_mb"), "param_mb: missing field"),
        (lambda d: d["loss"].pop("gamma5"), "loss.gamma5: missing field"),
        (lambda d: d.update(ps_bandwidth_mbps=0), "ps_bandwidth_mbps: Input should be greater than 0"),
        (lambda d: d.update(required_bandwidth_mbps=-1), "required_bandwidth_mbps"),
        (lambda d: d["instances"][2].update(compute_time_s=0), "instances.2.compute_time_s"),
        (lambda d: d["instances"][1].update(spot_price=-0.1), "instances.1.spot_price"),
        (lambda d: d["instances"][0].update(quota=-1), "instances.0.quota"),
        (lambda d: d["instances"][0].update(gpus="two"), "instances.0.gpus"),
        (lambda d: d["instances"].append(dict(d["instances"][0])), "duplicate instance type 'p3.2xlarge'"),
        (lambda d: d.update(instances=[]), "instances: List should have at least 1 item"),
        (lambda d: d.update(param_mb=float("nan")), "param_mb"),
        (lambda d: d["loss"].update(kappa=0.2), "loss.kappa: Input should be greater than or equal to 0.25"),
        (lambda d: d["loss"].update(kappa=1.5), "loss.kappa: Input should be less than or equal to 1"),
        (lambda d: d["contention"].update(by="bandwidth"), "contention.by: Input should be 'workers' or 'load'"),
        (lambda d: d["contention"].update(overlap=-0.1), "contention.overlap: Input should be greater than or equal to 0"),
        (lambda d: d["contention"].update(overlap=1.5), "contention.overlap: Input should be less than or equal to 1"),
        (lambda d: d["contention"].update(overlap_width=0), "contention.overlap_width: Input should be greater than 0"),
        (lambda d: d["contention"].update(link_cap="yes"), "contention.link_cap: Input should be a valid boolean"),
        (lambda d: d["loss"].update(batch_n_exponent=-2), "loss.batch_n_exponent: Input should be greater than or equal to -1.5"),
        (lambda d: d["loss"].update(batch_n_exponent=1.2), "loss.batch_n_exponent: Input should be less than or equal to 1"),
        (lambda d: d["loss"].update(batch_staleness=-0.1), "loss.batch_staleness: Input should be greater than or equal to 0"),
        (lambda d: d["loss"].update(batch_staleness=101), "loss.batch_staleness: Input should be less than or equal to 100"),
        (lambda d: d["loss"].update(batch_noise=-1), "loss.batch_noise: Input should be greater than or equal to 0"),
        (lambda d: d["loss"].update(batch_noise=2e7), "loss.batch_noise: Input should be less than or equal to 10000000"),
        (lambda d: d.update(uncertainty={"time_log_sd": -0.1}), "uncertainty.time_log_sd"),
        # strict types: a bool or a numeral in a string is a mistake to name, not a number to guess
        (lambda d: d.update(param_mb=True), "param_mb: Input should be a valid number"),
        (lambda d: d["instances"][0].update(gpus="8"), "instances.0.gpus: Input should be a valid integer"),
        (lambda d: d["instances"][0].update(quota=True), "instances.0.quota: Input should be a valid integer"),
        # type names the CLI's TYPE=N lists can name, told apart whatever their case
        (lambda d: d["instances"][0].update(type="a,b=1"), "instance type 'a,b=1' must be 1-100 ASCII letters"),
        (lambda d: d["instances"][0].update(type="p3.2xlarge\n"), "instance type 'p3.2xlarge\\n' must be"),
        (lambda d: d["instances"][0].update(type="p3.2xlarge@us-east-1"), "must be 1-100 ASCII letters, digits"),
        (lambda d: d["instances"][0].update(type="P3.2XLARGE") or d["instances"].append(shipped()["instances"][0]),
         "duplicate instance type 'p3.2xlarge'"),
        # each GPU holds a replica at batch_per_gpu: above the memory fit it runs out of memory
        (lambda d: d["instances"][3].update(max_batch_per_gpu=256),
         "instances.3: Value error, g3.16xlarge: batch_per_gpu 512 does not fit one GPU's memory; "
         "the memory fit (max_batch_per_gpu) admits at most 256"),
        (lambda d: d["instances"][3].update(max_batch_per_gpu=0), "instances.3.max_batch_per_gpu"),
    ],
)
def test_bad_profile_field_is_named(mutate, expected):
    data = shipped()
    mutate(data)
    with pytest.raises(UserInputError) as err:
        profile_from_dict(data, "p.json")
    msg = str(err.value)
    assert expected in msg and "\n" not in msg


def test_extra_keys_are_allowed():
    data = shipped()
    data["provenance"] = {"by": "test"}
    data["instances"][0]["interruption_band"] = 4
    assert profile_from_dict(data).instances[0].model_extra["interruption_band"] == 4


def test_unreadable_files(tmp_path):
    with pytest.raises(UserInputError, match="profile not found"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserInputError, match="not valid JSON"):
        load_profile(bad)
    top = tmp_path / "list.json"
    top.write_text("[]")
    with pytest.raises(UserInputError, match="JSON object"):
        load_profile(top)


def test_unknown_type_lists_known_ones():
    with pytest.raises(UserInputError, match="unknown instance type 'x9'.*p3.2xlarge"):
        load_profile(SHIPPED_PROFILE).instance("x9")
