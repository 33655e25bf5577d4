"""A provider's region form is data on its adapter class (``region_pattern``, ``region_words``,
``region_sample``); the contract's classmethods read it, so an adapter states the form once and never re-writes
the check."""

from __future__ import annotations

import pytest

from broker.core.provider import Provider
from broker.providers import provider_class


class _Narrow(Provider):
    name = "narrow"
    region_pattern = r"[a-z]+-\d"
    region_words = "<word>-<digit>, e.g. north-1"
    region_sample = "north-1"


def test_the_default_form_refuses_what_could_leave_an_endpoint_host_name():
    assert Provider.valid_region("us-east-1") and Provider.region_form() == "lowercase letters, digits and -"
    for bad in ("evil.example", "a/b", "x@y", "", "-a", None):
        assert not Provider.valid_region(bad)  # type: ignore[arg-type]


def test_an_adapter_narrows_it_with_data_only():
    assert _Narrow.valid_region("north-1") and not _Narrow.valid_region("north-12")
    assert not _Narrow.valid_region("north-1.evil")  # a full match, not a prefix
    assert _Narrow.region_form() == "<word>-<digit>, e.g. north-1" and _Narrow.region_example() == "north-1"


@pytest.mark.parametrize("name, good, bad", [("gcp", "europe-west4", "us-east-1"),
                                             ("oci", "eu-frankfurt-1", "us-central1"),
                                             ("aws", "us-gov-west-1", "us-central1")])
def test_each_cloud_accepts_its_own_form_only(name, good, bad):
    cls = provider_class(name)
    assert cls.valid_region(good) and cls.valid_region(cls.region_example())
    assert not cls.valid_region(bad) and cls.region_example() in cls.region_form()
