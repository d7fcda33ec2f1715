"""Flows that keep the pipeline's inputs fresh and answer its events: the catalog/price refresh
(cron), profiling on demand, and the re-plan a drift event asks for (automation)."""
from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_table_artifact

from flows.train_with_slo import fit_model, profile_clusters, profile_type
from tasks.core.atomic import atomic_write_json
from tasks.core.catalog import build_catalog
from tasks.pipeline import stages
from tasks.pipeline.params import TrainRequest
from tasks.pipeline.setup import open_setup
from tasks.providers.aws import AwsProvider, load_aws_config
from tasks.providers.aws_catalog import merge_live


@task(name="build-catalog")
def build_catalog_task(region: str, aws: dict) -> tuple[dict, str]:
    """The shipped catalog, with the region's live hardware and spot prices laid over it when AWS
    credentials are at hand (`aws`: AwsConfig fields, e.g. endpoint_url); says which it is."""
    import boto3

    catalog = build_catalog()
    if boto3.session.Session(profile_name=aws.get("profile_name")).get_credentials() is None:
        return catalog, "no AWS credentials: kept the shipped catalog (its spot prices are from 2022)"
    live = AwsProvider(load_aws_config({**aws, "region": region})).refresh_catalog()
    return merge_live(catalog, live), f"refreshed {len(live.types)} priced GPU types of {region} from the EC2 API"


def catalog_rows(catalog: dict, region: str) -> list[dict]:
    """The GPU types priced in `region`, as the table artifact's rows. The UI renders each cell as
    markdown, where a leading ">" (the interruption band ">20%") starts a block quote: escaped."""
    rows = []
    for t in catalog["types"]:
        r = t["regions"].get(region)
        if r and t["gpus"]:
            rows.append({"type": t["type"], "gpus": t["gpus"], "gpu": t["gpu_model"],
                         "on-demand $/h": r["on_demand_usd_per_h"], "spot avg $/h": r["spot_avg_usd_per_h"],
                         "spot now $/h": r.get("spot_current_usd_per_h"),
                         "interruption": escape_block_quote(r["interruption_label"])})
    return rows


def escape_block_quote(label: str | None) -> str | None:
    """A label as a markdown cell shows it: a leading ">" escaped (else it starts a block quote)."""
    return "\\" + label if label and label.startswith(">") else label


@flow(name="catalog-refresh")
def refresh_catalog(region: str = "us-east-1", out: str = "profiles/instance-catalog.json",
                    aws: dict | None = None) -> int:
    """Refresh the instance catalog (hardware, prices, interruption bands) and show one region:
    live from the EC2 API with credentials, else the shipped sources."""
    logger = get_run_logger()
    catalog, source = build_catalog_task(region, aws or {})
    logger.info(source)
    atomic_write_json(out, catalog)
    rows = catalog_rows(catalog, region)
    create_table_artifact(rows, key="instance-catalog", description=f"GPU types priced in {region}: {source}")
    logger.info("catalog: %d types, %d priced in %s", len(catalog["types"]), len(rows), region)
    return len(rows)


@flow(name="profile-workload")
def profile_workload(request: TrainRequest) -> str:
    """Profile a workload on its candidate types and fit the model, without training."""
    import uuid

    run_id = f"profile-{uuid.uuid4().hex[:8]}"
    run_dir = Path(request.artifacts_dir) / run_id

    setup = open_setup(request)
    measurements = profile_type.map(unmapped(setup), unmapped(run_id), request.candidates.types).result()
    clusters = profile_clusters(setup, run_id, measurements)
    fit_model(setup.profiling, measurements, clusters, run_dir)
    return str(run_dir / "profile")


@flow(name="replan-on-drift")
def replan_on_drift(resource_id: str, plan: int, artifacts_dir: str = "artifacts") -> str:
    """Asked for by the drift automation: tell the run's watch loop to refit and re-plan the plan
    its drift event named (it picks the request up at its next poll, and drops it if a re-plan
    has answered that plan since; it refits to its newest observation, not to the event's). The
    same request again rewrites the same file: running this twice does no more than once, and a
    late request never replaces one for a newer plan (stages.ask_for_replan). A run that is not
    live (no folder, or already reported) is left alone."""
    logger = get_run_logger()
    run_id = resource_id.removeprefix("spotfill.run.")
    run_dir = Path(artifacts_dir) / run_id
    if not run_dir.is_dir() or (run_dir / "summary.json").exists():
        logger.info("drift of %s ignored: the run is not live", run_id)
        return "ignored: not live"
    path, asked = stages.ask_for_replan(run_dir, plan)
    if asked != plan:
        logger.info("drift of plan %d of %s dropped: a request for plan %d is waiting", plan, run_id, asked)
        return f"dropped: plan {asked} is waiting"
    logger.info("re-plan of plan %d requested for %s", plan, run_id)
    return str(path)
