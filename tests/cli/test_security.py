"""Plug-in workloads through deployments only from the operator's allow-list; the local PS listens
on the loopback interface only."""
import socket

import pytest
from pydantic import ValidationError

from tasks.pipeline.params import TrainRequest

REQUEST = {"slo": {"target_loss": 1.0, "deadline_s": 60}, "candidates": {"types": ["p3.2xlarge"]}}


def test_deployment_refuses_a_plugin_not_on_the_allow_list(monkeypatch):
    monkeypatch.delenv("SPOTFILL_ALLOWED_WORKLOADS", raising=False)
    with pytest.raises(ValidationError, match="SPOTFILL_ALLOWED_WORKLOADS"):
        TrainRequest.model_validate(REQUEST | {"workload": "os:system"})
    monkeypatch.setenv("SPOTFILL_ALLOWED_WORKLOADS", "my_models:build, other:*")
    assert TrainRequest.model_validate(REQUEST | {"workload": "my_models:build"}).workload == "my_models:build"
    assert TrainRequest.model_validate(REQUEST | {"workload": "other:anything"}).workload == "other:anything"
    with pytest.raises(ValidationError, match="not allowed"):
        TrainRequest.model_validate(REQUEST | {"workload": "my_models:other"})
    assert TrainRequest.model_validate(REQUEST | {"workload": "resnet20"}).workload == "resnet20"  # built-ins


def test_the_local_user_is_not_restricted(monkeypatch):
    monkeypatch.delenv("SPOTFILL_ALLOWED_WORKLOADS", raising=False)
    request = TrainRequest.model_validate(REQUEST | {"workload": "my_models:build"}, context={"local_user": True})
    assert request.workload == "my_models:build"


def test_the_local_users_plugin_passes_the_flows_own_validation(monkeypatch):
    """`spotfill run` calls the flow in its own process; Prefect validates the flow's parameters
    again, without the CLI's context: the CLI's plug-in must pass there too."""
    from flows.train_with_slo import train_with_slo
    from tasks.pipeline.plugin_policy import allow_local_user

    monkeypatch.delenv("SPOTFILL_ALLOWED_WORKLOADS", raising=False)
    request = TrainRequest.model_validate(REQUEST | {"workload": "my_models:build"}, context={"local_user": True})
    with pytest.raises(Exception, match="not allowed through a deployment"):
        train_with_slo.validate_parameters({"request": request})
    allow_local_user(request.workload)
    assert train_with_slo.validate_parameters({"request": request})["request"].workload == "my_models:build"
    with pytest.raises(ValidationError, match="not allowed"):  # only that one
        TrainRequest.model_validate(REQUEST | {"workload": "os:system"})


def _listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state on `port`, from /proc/net/tcp (hex, little-endian IPv4)."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="Linux only")
def test_local_ps_store_listens_on_loopback_only(monkeypatch):
    from tasks.runtime import wire

    monkeypatch.delenv("SPOTFILL_PS_BIND", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = wire.host_store(port, timeout_s=5)
    store.set("k", "v")
    assert _listening_addresses(port) == {"127.0.0.1"}
