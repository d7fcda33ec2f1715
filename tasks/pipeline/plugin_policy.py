"""Which plug-in workloads (`module:function`) a flow run may load when its parameters come from a
deployment, that is from anyone who can reach the Prefect server (the open-source server has no
authentication): only those the operator lists in SPOTFILL_ALLOWED_WORKLOADS, comma-separated
`module:function` or `module:*`, set on the machine that runs the flow. Built-in workloads are
always allowed. The CLI, run by the local user with their own rights, is not restricted.
"""
from __future__ import annotations

import os

ENV = "SPOTFILL_ALLOWED_WORKLOADS"


def allowed_plugins() -> set[str]:
    return {item.strip() for item in os.environ.get(ENV, "").split(",") if item.strip()}


def check_deployment_workload(spec: str) -> None:
    """ValueError (a validation error in Prefect) unless `spec` is a built-in or allow-listed."""
    if ":" not in spec:
        return  # a built-in name; an unknown one fails where workloads are built
    allowed = allowed_plugins()
    if spec in allowed or f"{spec.partition(':')[0]}:*" in allowed:
        return
    raise ValueError(f"plug-in workload {spec!r} is not allowed through a deployment: the operator lists "
                     f"permitted ones in {ENV} (module:function or module:*) on the machine that runs flows")


def allow_local_user(spec: str) -> None:
    """The CLI's own run (the local user, who may run any plug-in): allow-list `spec` in this
    process, where the flow runs and validates its parameters again without the CLI's context."""
    if ":" in spec:
        os.environ[ENV] = ",".join(sorted(allowed_plugins() | {spec}))
