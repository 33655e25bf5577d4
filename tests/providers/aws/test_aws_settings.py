"""AWS settings (issue 15 conventions): keys and profile from `.env` reach boto3 (which alone reads only the
environment and ~/.aws); the region follows boto3's own order (AWS_DEFAULT_REGION, else the profile's), then
AWS_REGION, then us-east-1.  No network: a boto3 Session is built, no client call is made."""

from __future__ import annotations

import pytest

from broker.core.config import settings


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    for v in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.chdir(tmp_path)
    settings.cache_clear()
    yield tmp_path
    settings.cache_clear()


def _api():
    from broker.providers.aws.api import AWSApi

    return AWSApi()


def test_keys_in_dotenv_configure_aws_and_reach_the_boto3_session(fresh):
    assert not _api().configured()
    (fresh / ".env").write_text("AWS_ACCESS_KEY_ID=AKIAEXAMPLEONLY0000\nAWS_SECRET_ACCESS_KEY=not-a-real-secret\n")
    settings.cache_clear()
    api = _api()
    assert api.configured()
    creds = api.boto_session().get_credentials()
    assert creds.access_key == "AKIAEXAMPLEONLY0000" and creds.secret_key == "not-a-real-secret"
    assert "not-a-real-secret" not in repr(settings())  # a SecretStr: never printed


def test_region_follows_the_profile_then_aws_region(fresh, monkeypatch):
    cfg = fresh / "aws-config"
    cfg.write_text("[profile learner]\nregion = eu-west-1\n")
    creds = fresh / "aws-credentials"
    creds.write_text("[learner]\naws_access_key_id = AKIAEXAMPLEONLY0000\naws_secret_access_key = x\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(cfg))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "learner")
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    settings.cache_clear()
    assert _api().region == "eu-west-1"  # the profile's region wins over AWS_REGION (boto3's order)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    settings.cache_clear()
    assert _api().region == "us-west-2"
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    cfg.write_text("[profile learner]\noutput = json\n")
    settings.cache_clear()
    assert _api().region == "ap-south-1"  # no region anywhere in boto3's chain: AWS_REGION


def test_broker_home_from_dotenv_is_ignored(fresh, monkeypatch):
    from broker.core.config import home_path

    monkeypatch.delenv("BROKER_HOME", raising=False)
    (fresh / ".env").write_text(f"BROKER_HOME={fresh / 'my-home'}\n")
    settings.cache_clear()
    assert home_path() != fresh / "my-home"  # a cloned folder's .env must not choose the ledger


def test_broker_check_sees_aws_keys_in_dotenv(fresh):
    from broker.providers.aws import AWSProvider

    assert not AWSProvider().check().configured
    (fresh / ".env").write_text("AWS_ACCESS_KEY_ID=AKIAEXAMPLEONLY0000\nAWS_SECRET_ACCESS_KEY=not-a-real-secret\n")
    settings.cache_clear()
    chk = AWSProvider().check()
    assert chk.configured and ".env" in chk.detail and "not-a-real-secret" not in repr(chk)
