"""Offer construction for millions of offers (slots, interned texts, a direct __init__) keeps the dataclass
behaviour: keyword-only with the same defaults and required fields, frozen, ints of float fields stored as floats,
replace/asdict/equality/pickle."""

from __future__ import annotations

import dataclasses
import pickle
from datetime import datetime, timezone

import pytest

from broker.core.model import Offer

T = datetime(2026, 1, 1, tzinfo=timezone.utc)
ROW = dict(provider="vast", offer_id="1", instance_type="2x RTX 4090", region="US", gpu_name="RTX 4090",
           gpu_count=2, gpu_mem_gib=24, vcpus=16, usd_per_hour=1, price_source="live", price_time=T)


def test_fields_defaults_and_floats():
    o = Offer(**ROW)
    assert [f.name for f in dataclasses.fields(Offer)][:3] == ["provider", "offer_id", "instance_type"]
    assert o.zone is None and o.ram_gib == 0.0 and o.min_billed_seconds == 60.0 and o.private_network is False
    assert o.attrs == {} and Offer(**ROW).attrs is not o.attrs  # a fresh dict each
    for n in ("gpu_mem_gib", "vcpus", "ram_gib", "usd_per_hour", "storage_usd_per_gib_month", "min_billed_seconds"):
        assert type(getattr(o, n)) is float, n
    assert o.gpu_count == 2 and type(o.gpu_count) is int
    assert not hasattr(o, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.usd_per_hour = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="missing"):
        Offer(provider="vast")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Offer("vast", **{k: v for k, v in ROW.items() if k != "provider"})  # type: ignore[misc]


def test_replace_asdict_eq_pickle_and_from_dict():
    o = Offer(**ROW, attrs={"host_id": 7})
    r = dataclasses.replace(o, zone="AD-1")
    assert r.zone == "AD-1" and r.offer_id == "1" and r.attrs == {"host_id": 7}
    assert dataclasses.asdict(o)["attrs"] == {"host_id": 7} and o == Offer(**ROW, attrs={"host_id": 7})
    assert pickle.loads(pickle.dumps(o)) == o
    from broker.core.model import to_json

    assert Offer.from_dict(to_json(o)) == o


def test_shared_texts_are_interned():
    a = Offer(**{**ROW, "instance_type": "".join(["2x RTX ", "4090"]), "region": "".join(["U", "S"])})
    b = Offer(**{**ROW, "instance_type": "".join(["2x ", "RTX 4090"]), "region": "".join(["US", ""])})
    assert a.instance_type is b.instance_type and a.region is b.region


def test_gc_paused_restores_the_collector_as_it_was():
    import gc

    from broker.core.model import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed build")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # paused by someone else: left paused
    finally:
        gc.enable()


def _recording(monkeypatch, module, name):
    """Wrap ``module.name`` so that each call records whether the cyclic collector was running."""
    import gc

    seen: list[bool] = []
    real = getattr(module, name)

    def wrapper(*a, **kw):
        seen.append(gc.isenabled())
        return real(*a, **kw)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def test_bulk_offer_builds_run_with_the_collector_paused(monkeypatch, tmp_path):
    """A market answer, a price snapshot and the interruptible twins are built by the thousand: the cyclic
    collector re-scanning the offers built so far was 55-60 % of building a million (bench/planner_build.py)."""
    import gc

    import httpx
    import respx

    from broker.core.model import Requirements
    from broker.plan import catalog, interruptible
    from broker.providers.vast import VastProvider
    from broker.providers.vast import offers as vast_offers
    from tests.providers.vast.test_vast import URL, offer_row

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("VAST_API_URL", raising=False)
    seen = _recording(monkeypatch, vast_offers, "offer_from_row")
    with respx.mock(base_url=URL) as mock:
        mock.post("/api/v0/bundles/").respond(200, json={"offers": [offer_row(id=i) for i in range(1, 301)]})
        got = VastProvider(api_key="vk-test-0123456789abcdef", sleep=lambda s: None).live_offers(Requirements())
    assert len(got) == 300 and seen == [False] * 300 and gc.isenabled()

    catalog._CACHE.clear()
    seen = _recording(monkeypatch, catalog, "_interruptible_attrs")
    snap = catalog.snapshot_offers("aws")
    assert snap and seen and not any(seen) and gc.isenabled()

    seen = _recording(monkeypatch, interruptible, "variant")
    twins = interruptible.variants(snap)
    assert twins and seen and not any(seen) and gc.isenabled()
