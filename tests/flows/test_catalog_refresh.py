"""The catalog refresh: live from the EC2 API (moto's server) with credentials, the shipped
catalog without, and saying which."""
import pytest

from tasks.core.catalog import build_catalog


@pytest.mark.integration
def test_with_credentials_the_refresh_fetches_hardware_and_spot_prices(moto_endpoint):
    from flows.maintenance import build_catalog_task

    catalog, source = build_catalog_task.fn("us-east-1", {"endpoint_url": moto_endpoint})
    assert source.startswith("refreshed") and "from the EC2 API" in source
    assert catalog["refreshed"]["region"] == "us-east-1"
    g5 = next(t for t in catalog["types"] if t["type"] == "g5.xlarge")
    region = g5["regions"]["us-east-1"]
    assert region["spot_current_usd_per_h"] > 0 and region["spot_min_usd_per_h"] <= region["spot_max_usd_per_h"]
    assert region["on_demand_usd_per_h"] == next(t for t in build_catalog()["types"]
                                                 if t["type"] == "g5.xlarge")["regions"]["us-east-1"]["on_demand_usd_per_h"]
    assert (g5["gpus"], g5["network_mbps"]) == (1, 312.5)  # DescribeInstanceTypes: 2.5 Gbit/s baseline, in MB/s


def test_without_credentials_it_says_so_and_keeps_the_shipped_catalog(monkeypatch, tmp_path):
    from flows.maintenance import build_catalog_task

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    catalog, source = build_catalog_task.fn("us-east-1", {})
    assert source.startswith("no AWS credentials") and catalog == build_catalog()


def test_the_catalog_table_escapes_the_band_that_reads_as_a_block_quote():
    from flows.maintenance import catalog_rows

    catalog = build_catalog()
    bands = {row["interruption"] for row in catalog_rows(catalog, "us-east-1")}
    shipped = {t["regions"]["us-east-1"]["interruption_label"] for t in catalog["types"]
               if t["gpus"] and "us-east-1" in t["regions"]}
    assert ">20%" in shipped and "\\>20%" in bands and not any(b and b.startswith(">") for b in bands)
