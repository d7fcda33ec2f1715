"""Serve the pipeline's deployments from this process: `python -m flows.serve`.

The deployments are those of prefect.yaml (one definition, whether served from here or deployed
to a work pool with `prefect deploy --all`): names, entrypoints, parameters, schedules and
triggers are read from it.

- train-with-slo: the main flow, run by hand from the UI (its parameters are validated there);
- catalog-refresh: every 6 hours;
- profile-workload: on demand;
- replan-on-drift: run by an automation whenever a run whose drift_action is "automation"
  reports drift.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from prefect import serve
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
from prefect.flows import load_flow_from_entrypoint

PREFECT_YAML = Path(__file__).resolve().parents[1] / "prefect.yaml"


def deployments(path: Path = PREFECT_YAML) -> list:
    """prefect.yaml's deployments, ready to serve."""
    spec = yaml.safe_load(path.read_text())
    served = []
    for d in spec["deployments"]:
        flow = load_flow_from_entrypoint(str(path.parent / d["entrypoint"]))
        crons = [s["cron"] for s in d.get("schedules") or [] if "cron" in s]
        triggers = [DeploymentEventTrigger(name=t.get("name", d["name"]), enabled=t.get("enabled", True),
                                           expect=set(t["expect"]), match=t["match"], parameters=t.get("parameters"))
                    for t in d.get("triggers") or []]
        served.append(flow.to_deployment(name=d["name"], description=d.get("description"),
                                         parameters=d.get("parameters") or {}, cron=crons[0] if crons else None,
                                         triggers=triggers or None))
    return served


if __name__ == "__main__":
    serve(*deployments())
