"""Start-up hygiene: `broker --help` loads no pydantic / rich help styling, errors are pydantic-free, and settings
are read without pydantic-settings unless a .env file needs it (bench/cli_startup.py measures the times)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def modules_after(code: str, cwd: Path, env: dict | None = None) -> set[str]:
    prog = code + "\nimport json, sys; sys.stderr.write('MODS=' + json.dumps(sorted(sys.modules)) + '\\n')"
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    cp = subprocess.run([sys.executable, "-c", prog], cwd=cwd, env=e, capture_output=True, text=True, timeout=120)
    line = [ln for ln in cp.stderr.splitlines() if ln.startswith("MODS=")]
    assert line, cp.stdout + cp.stderr
    return set(json.loads(line[-1][5:]))


def test_help_imports_no_pydantic_or_rich_help(tmp_path):
    mods = modules_after("import sys\nfrom broker.cli import app as cli\ntry:\n    cli.main(['--help'])\nexcept SystemExit:\n"
                         "    pass", tmp_path, {"BROKER_HOME": str(tmp_path / "h")})
    for heavy in ("pydantic", "pydantic_settings", "typer.rich_utils", "rich.markdown", "rich.console", "yaml",
                  "httpx", "asyncssh"):
        assert heavy not in mods, heavy


def test_errors_module_is_pydantic_free(tmp_path):
    mods = modules_after("import broker.core.errors, broker.core.limits, broker.core.config", tmp_path)
    assert "pydantic" not in mods and "typer" not in mods


def test_plan_reads_settings_without_pydantic_settings(tmp_path):
    mods = modules_after("from broker.core.config import settings\ns = settings()\nassert s.vast_api_key is None",
                         tmp_path, {"BROKER_HOME": str(tmp_path / "h")})
    assert "pydantic_settings" not in mods
    (tmp_path / ".env").write_text("VAST_API_KEY=k-from-dotenv\n")
    mods = modules_after("from broker.core.config import settings\n"
                         "assert settings().vast_api_key.get_secret_value() == 'k-from-dotenv'",
                         tmp_path)
    assert "pydantic_settings" in mods


ENV = {"VAST_API_KEY": "k-123", "vast_api_url": "https://x", "OCI_INSTANCE_PRINCIPAL": "1",
       "AWS_DEFAULT_REGION": "eu-west-1", "BROKER_WATCHDOG_INTERVAL_S": "2.5", "BROKER_WATCHDOG_AUTOSTART": "false",
       "BROKER_SLURM_HOST": "me@login", "BROKER_HOME": "/tmp/somewhere"}


def test_environment_fast_path_matches_pydantic_settings(tmp_path, monkeypatch):
    from broker.core import config
    monkeypatch.chdir(tmp_path)  # no .env here
    for k in list(os.environ):
        if k.upper() in {n.upper() for n in ENV} or k.upper().startswith(("VAST_", "OCI_", "BROKER_")):
            monkeypatch.delenv(k, raising=False)
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    fast = config._from_environment()
    full = config._settings_class()()
    names = [f.name for f in dataclasses.fields(config.EnvSettings)]
    assert set(names) == set(type(full).model_fields) == set(config._fields_class().model_fields)

    def plain(v):
        return v.get_secret_value() if hasattr(v, "get_secret_value") else v

    assert {n: plain(getattr(fast, n)) for n in names} == {n: plain(getattr(full, n)) for n in names}
    assert fast.vast_api_key.get_secret_value() == "k-123" and "k-123" not in repr(fast)
    assert fast.aws_region == "eu-west-1" and fast.oci_instance_principal is True
    assert fast.broker_watchdog_autostart is False and fast.broker_watchdog_interval_s == 2.5
    assert {n: f.default for n, f in config._fields_class().model_fields.items()} == {
        f.name: f.default for f in dataclasses.fields(config.EnvSettings)}


@pytest.mark.parametrize("name,value", [("BROKER_WATCHDOG_AUTOSTART", "maybe"), ("BROKER_WATCHDOG_INTERVAL_S", "5s")])
def test_environment_fast_path_rejects_what_pydantic_rejects(tmp_path, monkeypatch, name, value):
    from pydantic import ValidationError

    from broker.core import config
    from broker.core.errors import BadInput

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    with pytest.raises(BadInput, match=name):
        config._from_environment()
    with pytest.raises(ValidationError):
        config._settings_class()()


def test_settings_class_still_importable():
    from broker.core.config import Settings

    assert "vast_api_key" in Settings.model_fields
    with pytest.raises(ImportError):
        from broker.core.config import NoSuchThing  # noqa: F401


def test_plan_does_not_coerce_options_through_pydantic_adapters(tmp_path):
    """typer 0.29 builds a pydantic TypeAdapter for every CLI parameter on every start (+120 ms for ``broker plan``,
    bench/cli_startup.py); pyproject pins ``typer<0.29``."""
    mods = modules_after("from broker.cli import app as cli\ntry:\n    cli.main(['plan', '--budget', '5'])\nexcept SystemExit:\n"
                         "    pass", tmp_path, {"BROKER_HOME": str(tmp_path / "h"), "COLUMNS": "100"})
    assert "typer._adapters" not in mods


def test_records_build_their_schema_on_first_use():
    """Importing broker.core.model imports no pydantic; the ledger / cluster records (broker.core.records, imported
    from there) build no schema until first used (``defer_build``)."""
    code = ("import sys\nimport broker.core.model as m, broker.core.provider as p\nassert 'pydantic' not in sys.modules\n"
            "m.Requirements(budget_usd=None)\nassert 'pydantic' not in sys.modules\n"
            "from broker.core.records import Cluster, ClusterNode, InstanceInfo, Run\n"
            "assert 'pydantic' in sys.modules and Cluster is sys.modules['broker.core.records'].Cluster\n"
            "assert not any(c.__pydantic_complete__ for c in (Run, Cluster, ClusterNode, InstanceInfo))\n"
            "ClusterNode(node_rank=0, host='h', private_ip='10.0.0.1')\nassert ClusterNode.__pydantic_complete__\n"
            "assert not Run.__pydantic_complete__")
    cp = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                        text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr


def test_plan_imports_no_pydantic(tmp_path):
    """``broker plan`` works on the planner's dataclasses only: no pydantic import (~95 ms), no plugin scan, no
    schema build (bench/cli_startup.py); the adapters reach their pydantic records only inside lifecycle verbs."""
    mods = modules_after("from broker.cli import app as cli\ntry:\n    cli.main(['plan', '--budget', '5'])\nexcept SystemExit:\n"
                         "    pass", tmp_path, {"BROKER_HOME": str(tmp_path / "h"), "COLUMNS": "100"})
    assert "broker.plan.planner" in mods and "broker.providers.aws" in mods  # the plan really ran over the adapters
    for heavy in ("pydantic", "pydantic_core", "broker.core.records", "typer._adapters"):
        assert heavy not in mods, heavy


def test_unknown_lazy_name_is_an_attribute_error():
    import broker.core.model
    import broker.core.provider

    with pytest.raises(ImportError):
        from broker.core.model import NoSuchThing  # noqa: F401
    with pytest.raises(AttributeError):
        broker.core.provider.NoSuchThing  # noqa: B018


def test_plan_json_keeps_its_shape(tmp_path, monkeypatch):
    """``plan --json`` of the dataclass plan is what ``model_dump(mode="json")`` of the pydantic models gave: the
    same keys in field order, pydantic's own dump of the same values (UTC times as ``...Z``, topology by value),
    float fields as floats whatever the adapter passed (``vcpus=2`` of the local machine prints ``2.0``); and the
    chosen option reads back (``PlanOption.from_dict``, as a run's ledger plan does)."""
    from dataclasses import fields

    from pydantic import TypeAdapter
    from typer.testing import CliRunner

    import broker.plan.planner
    from broker.plan import catalog
    from broker.cli.app import app
    from broker.core.config import settings
    from broker.core.model import Offer, Plan, PlanOption

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith(("AWS_", "VAST_", "OCI_")):
            monkeypatch.delenv(k, raising=False)
    settings.cache_clear()
    catalog._CACHE.clear()
    seen: list = []
    real = broker.plan.planner.plan
    monkeypatch.setattr(broker.plan.planner, "plan", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    r = CliRunner().invoke(app, ["plan", "--budget", "5", "--cpu-ok", "--offline", "--json"])
    settings.cache_clear()
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    p = seen[0]
    assert list(data) == ["schema_version", "chosen", "next_step", "plan"] and data["schema_version"] == 1
    assert list(data["plan"]) == [f.name for f in fields(Plan)]
    # an option's fields in their order, then its reasons as data (``rejections``: added, the old fields kept)
    assert list(data["chosen"]) == [f.name for f in fields(PlanOption)] + ["rejections"]

    def without_rejections(opt: dict) -> dict:
        assert [r["text"] for r in opt["rejections"]] == opt["rejected"]
        assert all(list(r) == ["kind", "text", "next_step", "lifted_by"] for r in opt["rejections"])
        return {k: v for k, v in opt.items() if k != "rejections"}

    plan_data = dict(data["plan"], options=[without_rejections(o) for o in data["plan"]["options"]],
                     rejected=[without_rejections(o) for o in data["plan"]["rejected"]])
    assert plan_data == TypeAdapter(Plan).dump_python(p, mode="json")
    assert without_rejections(data["chosen"]) == TypeAdapter(PlanOption).dump_python(p.chosen, mode="json")
    assert data["plan"]["created_at"].endswith("Z") and data["chosen"]["topology"] == p.chosen.topology.value
    float_fields = [f.name for f in fields(Offer) if f.type == "float"]
    offers = [o for opt in data["plan"]["options"] + data["plan"]["rejected"] for o in opt["offers"]]
    assert any(o["provider"] == "local" for o in offers)
    for o in offers:
        assert list(o) == [f.name for f in fields(Offer)]
        assert all(isinstance(o[n], float) for n in float_fields), o
    assert PlanOption.from_dict(data["chosen"]) == p.chosen


def test_plan_does_not_import_the_click_package(tmp_path):
    """Typer >= 0.26 vendors click (typer._click); importing the separate click package too cost ~10 ms per start."""
    mods = modules_after("from broker.cli import app as cli\ntry:\n    cli.main(['plan', '--budget', '5'])\nexcept SystemExit:\n"
                         "    pass", tmp_path, {"BROKER_HOME": str(tmp_path / "h"), "COLUMNS": "100"})
    import typer

    if hasattr(typer, "_click"):
        assert "click" not in mods


def test_plan_builds_only_its_own_commands(tmp_path):
    """`broker plan` imports the plan command module only (the others and their Typer signatures cost ~15 ms)."""
    mods = modules_after("from broker.cli import app as cli\ntry:\n    cli.main(['-v', 'plan', '--budget', '5'])\nexcept "
                         "SystemExit:\n    pass", tmp_path, {"BROKER_HOME": str(tmp_path / "h"), "COLUMNS": "100"})
    assert "broker.cli.plan" in mods
    assert not {m for m in mods if m.startswith("broker.cli.")} - {"broker.cli", "broker.cli.app", "broker.cli.plan", "broker.cli.report",
                                                                  "broker.cli.fastplan"}


def test_status_on_an_empty_home_imports_no_pydantic_or_rich(tmp_path):
    """`broker status` with nothing in the ledger reads no record (the pydantic records load on the first row) and
    lays out nothing (no rich): bench/cli_startup.py measures it; a run in the ledger still shows through rich."""
    env = {"BROKER_HOME": str(tmp_path / "h"), "COLUMNS": "100"}
    code = "from broker.cli import app as cli\ntry:\n    cli.main(['status'])\nexcept SystemExit:\n    pass"
    mods = modules_after(code, tmp_path, env)
    assert "broker.money.ledger" in mods and "broker.money.accounting" in mods
    for heavy in ("pydantic", "broker.core.records", "rich.console", "rich.table"):
        assert heavy not in mods, heavy
    from datetime import datetime, timezone

    from broker.money.ledger import Ledger
    from broker.core.records import Run

    Ledger(tmp_path / "h" / "ledger.sqlite").create_run(Run(id="20261201-000000-abc123", name="t", provider="local",
                                                            topology="local", status="succeeded",
                                                            created_at=datetime.now(timezone.utc)))
    mods = modules_after(code, tmp_path, env)  # in a pipe: broker.cli.faststatus prints the ended run's row
    assert not {"pydantic", "broker.core.records", "rich.table", "typer"} & mods
    mods = modules_after(code, tmp_path, {**env, "FORCE_COLOR": "1"})  # as on a terminal: rich lays it out
    assert "broker.core.records" in mods and "rich.table" in mods


def test_status_on_an_empty_home_prints_what_the_rich_path_printed(tmp_path):
    env = dict(os.environ, BROKER_HOME=str(tmp_path / "h"), PYTHONPATH=str(REPO), COLUMNS="100")
    cp = subprocess.run([sys.executable, "-m", "broker", "status"], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == ("no runs yet (`broker run recipes/ddp_2node.yaml` starts one).\n"
                         "watchdog: not running (a paid `broker run` starts it; or `broker watchdog`)\n"
                         "no live resources (nothing is billing).\n")
