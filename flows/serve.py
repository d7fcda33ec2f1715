"""Serve the pipeline's deployments from this process: `python -m flows.serve`.

- train-with-slo: the main flow, run by hand from the UI (its parameters are validated there);
- catalog-refresh: every 6 hours;
- profile-workload: on demand;
- replan-on-drift: run by an automation whenever a `spotfill.run.drift` event arrives.
"""
from __future__ import annotations

from prefect import serve
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

from flows.maintenance import profile_workload, refresh_catalog, replan_on_drift
from flows.train_with_slo import train_with_slo
from tasks.pipeline.commands import demo_request


def deployments(artifacts_dir: str = "artifacts") -> list:
    demo = demo_request(artifacts_dir).model_dump()
    return [
        train_with_slo.to_deployment(name="train-with-slo", parameters={"request": demo},
                                     description="Reach the target loss before the deadline at the lowest cost."),
        refresh_catalog.to_deployment(name="catalog-refresh", cron="0 */6 * * *"),
        profile_workload.to_deployment(name="profile-workload", parameters={"request": demo}),
        replan_on_drift.to_deployment(
            name="replan-on-drift",
            triggers=[DeploymentEventTrigger(
                name="re-plan on drift", expect={"spotfill.run.drift"},
                match={"prefect.resource.id": "spotfill.run.*", "spotfill.drift-action": "automation"},
                parameters={"resource_id": "{{ event.resource.id }}", "artifacts_dir": "{{ event.payload.artifacts_dir }}",
                            "speed_ratio": "{{ event.payload.speed_ratio }}"})]),
    ]


if __name__ == "__main__":
    serve(*deployments())
