"""Shipped price snapshots and the refreshed overlay (broker.plan.catalog)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from broker.plan import catalog
from broker.providers.oci import prices as oci_prices
from broker.providers.vast import snapshot as vast_snapshot
from broker.core.model import Offer, Requirements

# ../shared beside the checkout (developers' machines and CI lay it there)
REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "prices"


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    catalog._CACHE.clear()
    yield tmp_path / "home"
    catalog._CACHE.clear()


def by_type(provider: str) -> dict[str, Offer]:
    return {o.instance_type: o for o in catalog.snapshot_offers(provider)}


def test_every_cloud_has_a_dated_snapshot_with_source():
    for p in ("vast", "oci", "aws"):
        date, source = catalog.snapshot_info(p)
        assert date == "2026-11-29"
        assert source and "compiled for broker on 2026-11-29" in source
    assert "SkyPilot" in catalog.snapshot_info("vast")[1]
    notes = " ".join(catalog.snapshot_meta("vast")["notes"])
    assert "ASSUMPTION" in notes and "0.10-0.20" in notes


def test_vast_offers_from_medians():
    o = by_type("vast")["2x RTX 3090"]
    assert (o.gpu_name, o.gpu_count, o.gpu_mem_gib, o.usd_per_hour) == ("RTX 3090", 2, 24.0, 0.33)
    assert o.region == "Quebec, CA, NA" and o.zone is None
    assert o.private_network is False
    assert o.storage_usd_per_gib_month == vast_snapshot.VAST_STORAGE_USD_PER_GIB_MONTH
    assert o.min_billed_seconds == 0
    assert o.price_source == "snapshot 2026-11-29 (SkyPilot catalog medians)"
    assert o.price_time == datetime(2026, 11, 29, tzinfo=timezone.utc)
    assert by_type("vast")["2x RTX 4070S Ti"].gpu_mem_gib == 15.99  # 16376 MiB / 1024


def test_oci_and_aws_offers():
    a10 = by_type("oci")["VM.GPU.A10.1"]
    assert (a10.usd_per_hour, a10.gpu_count, a10.gpu_mem_gib, a10.vcpus) == (2.0, 1, 24.0, 30.0)
    assert a10.region is None and a10.zone is None and a10.private_network and a10.min_billed_seconds == 60
    assert a10.price_source == "snapshot 2026-11-29 (third-party list prices)"
    g5 = by_type("aws")["g5.xlarge"]
    assert (g5.usd_per_hour, g5.vcpus, g5.region, g5.private_network, g5.min_billed_seconds) == (
        1.006, 4.0, "us-east-1", True, 60)
    assert len(by_type("oci")) == 8 and len(by_type("aws")) == 9


def test_filter_by_requirements():
    a10 = catalog.snapshot_offers("oci", Requirements(gpu_names=["A10"], min_gpu_mem_gib=16))
    assert sorted(o.instance_type for o in a10) == ["BM.GPU.A10.4", "VM.GPU.A10.1", "VM.GPU.A10.2"]  # not A100
    big = catalog.snapshot_offers("aws", Requirements(min_gpu_mem_gib=40))
    assert {o.gpu_name for o in big} == {"A100-40GB", "H100"}
    # 2 nodes x 1 GPU: a single-GPU Vast host fits no topology, a single-GPU OCI VM fits multi-node
    vast = {o.instance_type for o in catalog.snapshot_offers("vast", Requirements(nodes=2, min_gpu_mem_gib=0))}
    assert "1x RTX 4090" not in vast and "2x RTX 4090" in vast
    oci = {o.instance_type for o in catalog.snapshot_offers("oci", Requirements(nodes=2, min_gpu_mem_gib=0))}
    assert "VM.GPU2.1" in oci


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="reference price files not present")
def test_shipped_snapshots_are_built_from_the_reference(tmp_path):
    out = tmp_path / "built"
    catalog.build_shipped(REFERENCE, out)
    for p in ("vast", "oci", "aws"):
        assert (out / f"{p}.csv").read_text() == catalog.shipped_path(p).read_text(), p


def test_refresh_writes_an_overlay_that_takes_precedence(home):
    live = Offer(provider="vast", offer_id="12345", instance_type="2x RTX 4090", region="Oregon, US",
                 gpu_name="RTX 4090", gpu_count=2, gpu_mem_gib=23.99, vcpus=32, ram_gib=64, usd_per_hour=0.61,
                 storage_usd_per_gib_month=0.12, min_billed_seconds=0, price_source="live vast /bundles/",
                 price_time=datetime(2026, 12, 1, tzinfo=timezone.utc))
    path = catalog.refresh("vast", [live], now=datetime(2026, 12, 1, 8, tzinfo=timezone.utc))
    assert path == home / "catalog" / "vast.csv"
    date, source = catalog.snapshot_info("vast")
    assert date == "2026-12-01" and "broker catalog refresh" in source
    [o] = catalog.snapshot_offers("vast")
    assert (o.offer_id, o.usd_per_hour, o.storage_usd_per_gib_month, o.gpu_mem_gib) == ("12345", 0.61, 0.12, 23.99)
    assert o.price_source == "snapshot 2026-12-01 (live refresh)"
    assert catalog.snapshot_meta("vast")["overlay"] is True
    assert catalog.snapshot_info("oci")[0] == "2026-11-29"  # other providers keep the shipped one


def test_refresh_refuses_nothing_and_foreign_offers():
    with pytest.raises(ValueError, match="no live offers"):
        catalog.refresh("vast", [])
    aws = catalog.snapshot_offers("aws")[:1]
    with pytest.raises(ValueError):
        catalog.refresh("vast", aws)


def test_unknown_provider_has_no_snapshot():
    with pytest.raises(FileNotFoundError):
        catalog.snapshot_offers("nimbus")


def test_snapshot_price_of_one_type():
    assert catalog.snapshot_price("aws", "g5.xlarge") == 1.006
    assert catalog.snapshot_price("oci", "BM.GPU.H100.8") == 80.0
    assert catalog.snapshot_offer("oci", "VM.GPU.A10.2").gpu_count == 2
    assert catalog.snapshot_price("aws", "m5.large") is None
    assert catalog.snapshot_price("aws", None) is None
    assert catalog.snapshot_price("nimbus", "g5.xlarge") is None


def test_oci_price_list_parsing_and_shape_matching():
    data = {"items": [
        {"partNumber": "B1", "displayName": "Compute - GPU - A10",
         "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 2}]}]},
        {"partNumber": "B2", "displayName": "OCI - Compute - GPU - H100T",
         "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "MONTHLY_COMMIT", "value": 9},
                                                                          {"model": "PAY_AS_YOU_GO", "value": 10}]}]},
        {"partNumber": "B3", "displayName": "Compute - GPU - A100 80GB",
         "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 4}]}]},
        {"partNumber": "B4", "displayName": "Compute - Standard - E4 - OCPU",
         "currencyCodeLocalizations": [{"currencyCode": "USD", "prices": [{"model": "PAY_AS_YOU_GO", "value": 0.025}]}]},
    ]}
    skus = oci_prices.parse_oci_price_list(data)
    assert skus == {"a10": (2.0, "B1 Compute - GPU - A10"), "h100t": (10.0, "B2 OCI - Compute - GPU - H100T"),
                    "a100 80gb".replace(" ", ""): (4.0, "B3 Compute - GPU - A100 80GB")}
    assert oci_prices._oci_sku_for("A10", skus)[0] == 2.0
    assert oci_prices._oci_sku_for("A100", skus) is None  # not "A10"
    assert oci_prices._oci_sku_for("H100", skus)[0] == 10.0
    assert oci_prices._oci_sku_for("A100-80GB", skus)[0] == 4.0
    assert oci_prices._oci_sku_for("A100-40GB", skus) is None  # never the 80 GB price for the 40 GB shape
    assert oci_prices.parse_oci_price_list({}) == {}


def test_vast_snapshot_rows_carry_no_placeholder_cpu_or_ram():
    """The source lists 32 vCPU / 64 GiB for every Vast bucket (a placeholder): unknown stays unknown."""
    from broker.plan.catalog import snapshot_offers

    offers = snapshot_offers("vast")
    assert offers and all(o.vcpus == 0 and o.ram_gib == 0 for o in offers)


@pytest.mark.parametrize("date", ["29.11.2026", "2026-11-3x", "2026-W48-1", "unknown"])
def test_a_snapshot_date_not_in_yyyy_mm_dd_dates_its_prices_by_the_file(home, date):
    shipped = catalog.shipped_path("aws").read_text(encoding="utf-8")
    over = catalog.overlay_dir() / catalog.snapshot_file("aws")
    over.parent.mkdir(parents=True, exist_ok=True)
    over.write_text(shipped.replace("# date: 2026-11-29", f"# date: {date}"), encoding="utf-8")
    import os

    os.utime(over, (1_700_000_000, 1_700_000_000))
    o = by_type("aws")["g5.xlarge"]
    assert o.price_time == datetime.fromtimestamp(1_700_000_000, timezone.utc)
    assert o.price_source.startswith(f"snapshot {date}")
