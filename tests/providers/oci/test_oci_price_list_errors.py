"""`broker catalog refresh` for OCI names what failed: it printed a raw `[Errno -2] Name or service not known`."""

from __future__ import annotations

import httpx
import pytest

from broker.core.provider import ProviderError
from broker.providers.oci import prices


def _raising(exc):
    def get(url, **kw):
        raise exc
    return get


def test_a_name_that_does_not_resolve_is_said_in_words():
    err = httpx.ConnectError("[Errno -2] Name or service not known")
    with pytest.raises(ProviderError) as e:
        prices.oci_live_offers(_raising(err))
    text = str(e.value)
    assert text.startswith("oci: GET the public price list failed: cannot reach apexapps.oracle.com")
    assert "does not resolve" in text and "Errno" not in text
    assert "snapshot stays in use" in e.value.hint


@pytest.mark.parametrize("status", [403, 503])
def test_an_http_error_names_the_status(status):
    def get(url, **kw):
        return httpx.Response(status, request=httpx.Request("GET", url), text="no")

    with pytest.raises(ProviderError, match=f"answered HTTP {status}"):
        prices.oci_live_offers(get)


def test_an_answer_that_is_not_json_is_named():
    def get(url, **kw):
        return httpx.Response(200, request=httpx.Request("GET", url), text="<html>")

    with pytest.raises(ProviderError, match="not JSON"):
        prices.oci_live_offers(get)
