"""Serve the pipeline's deployments from this process: `python -m flows.serve [DEFINITIONS.yaml]`
(prefect.yaml unless another file of the same form is named: a test serves a copy with its own
schedule and parameters).

The deployments are those of prefect.yaml (one definition, whether served from here or deployed
to a work pool with `prefect deploy --all`): names, entrypoints, parameters, schedules and
triggers are read from it.

- train-with-slo: the main flow, run by hand from the UI (its parameters are validated there);
- nightly-retrain: the main flow on a nightly schedule, shipped off;
- catalog-refresh: every 6 hours;
- profile-workload: on demand;
- replan-on-drift: run by an automation when a run whose drift_action is "automation"
  reports drift (once per run and plan, one flow run at a time).
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml
from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
from prefect.flows import load_flow_from_entrypoint
from prefect.schedules import Cron

PREFECT_YAML = Path(__file__).resolve().parents[1] / "prefect.yaml"


def deployments(path: Path = PREFECT_YAML) -> list:
    """prefect.yaml's deployments, ready to serve: the same names, parameters, tags, schedules
    (active or not), concurrency limits and triggers as `prefect deploy` creates. Job variables
    are left out: they configure a work pool's infrastructure, and a served deployment has none
    (Prefect refuses them there)."""
    spec = yaml.safe_load(path.read_text())
    served = []
    for d in spec["deployments"]:
        flow = load_flow_from_entrypoint(str(path.parent / d["entrypoint"]))
        schedules = [Cron(s["cron"], timezone=s.get("timezone"), active=s.get("active", True),
                          parameters=s.get("parameters") or {}, slug=s.get("slug"))
                     for s in d.get("schedules") or []]
        triggers = [DeploymentEventTrigger(**({"name": d["name"]} | t)) for t in d.get("triggers") or []]
        limit = d.get("concurrency_limit")
        served.append(flow.to_deployment(
            name=d["name"], description=d.get("description"), parameters=d.get("parameters") or {},
            tags=d.get("tags"), schedules=schedules or None,
            concurrency_limit=ConcurrencyLimitConfig(**limit) if isinstance(limit, dict) else limit,
            triggers=triggers or None))
    return served


if __name__ == "__main__":
    definitions = Path(sys.argv[1]) if len(sys.argv) > 1 else PREFECT_YAML
    if not definitions.is_file():
        print(f"flows.serve: no deployment definitions at {definitions} (a prefect.yaml-like file)", file=sys.stderr)
        sys.exit(2)
    serve(*deployments(definitions))
