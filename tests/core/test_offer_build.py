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
