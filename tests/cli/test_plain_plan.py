"""`broker plan` into a pipe or file prints without rich (broker.cli.plan.PlainOut, broker.core.plaintable) exactly
the text rich prints there: the same plans rendered both ways, compared byte for byte."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from broker.cli.plan import PlainOut, RichOut, render_plan
from broker.core.model import Offer, Plan, PlanOption, Requirements

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)


def offer(provider: str, itype: str, *, region: str | None = "us-east-1", zone: str | None = None,
          gpu: str = "T4", n: int = 1, mem: float = 16, usd: float = 0.5,
          source: str = "snapshot 2026-11-29 (SkyPilot catalog medians)") -> Offer:
    return Offer(provider=provider, offer_id=itype, instance_type=itype, region=region, zone=zone, gpu_name=gpu,
                 gpu_count=n, gpu_mem_gib=mem, usd_per_hour=usd, price_source=source, price_time=T0)


def option(provider: str, topology: str, offers: list[Offer], *, worst: float, rejected: list[str] | None = None,
           next_step: str | None = None, interruptible: bool = False, expected: float | None = None,
           max_h: float | None = 9.87) -> PlanOption:
    per_h = sum(o.usd_per_hour for o in offers)
    return PlanOption(provider=provider, topology=topology, offers=offers, nodes=len(offers) or 1, gpus_per_node=1,
                      usd_per_hour=per_h, worst_case_usd=worst, hours=1.0, max_hours_within_budget=max_h,
                      price_source=offers[0].price_source if offers else "", rejected=rejected or [],
                      next_step=next_step, interruptible=interruptible, max_restarts=3 if interruptible else 0,
                      expected_usd=expected)


def req(**kw) -> Requirements:
    base = dict(nodes=2, gpus_per_node=1, min_gpu_mem_gib=16, hours=1.0, budget_usd=5.0, topology="any")
    base.update(kw)
    return Requirements(**base)


def plans() -> dict[str, Plan]:
    """Plans that exercise each part of the layout."""
    vast = offer("vast", "2x RTX 3090", region="Quebec, CA, NA", gpu="RTX 3090", n=2, mem=24, usd=0.34)
    g4 = offer("aws", "g4dn.xlarge", zone="us-east-1a", usd=0.53)
    g4b = offer("aws", "g4dn.xlarge", zone="us-east-1b", usd=0.53)
    longname = offer("gcp", "n1-highmem-96-with-a-very-long-accelerator-name+8xv100", region="us-central1",
                     zone="us-central1-a", gpu="V100", n=8, usd=21.5)
    oci = offer("oci", "VM.GPU.A10.2", region="us-ashburn-1", gpu="A10", n=2, mem=24, usd=4.0,
                source="live OCI list price 2026-12-01")
    rejected = [
        option("local", "local", [], worst=0, rejected=["this machine has no GPU and the job needs 2 GPU(s); allow "
                                                       "a CPU logic check (gloo) with cpu_ok: true in the recipe or "
                                                       "--cpu-ok"]),
        option("aws", "simulated", [g4], worst=0.62,
               rejected=["simulated needs one host with 2 GPUs (2 nodes x 1); this one has 1"]),
        option("gcp", "multi-node", [longname, longname], worst=43.01,
               rejected=["quota NVIDIA_V100_GPUS 0 of 16 gpus available in us-central1",
                         "worst case $43.01 at 1 h > budget $5.00; affords 0.11 h"],
               next_step="broker quota request --provider gcp --limit NVIDIA_V100_GPUS --value 16 "
                         "--region us-central1"),
        option("oci", "simulated", [oci], worst=5.0029,
               rejected=["worst case $5.0029 at 1 h is over the $5.00 budget by $0.0029; affords 0.99 h"]),
    ]
    notes = ["vast: snapshot 2026-11-29; live quote needs VAST_API_KEY",
             "aws: prices: AWS us-east-1 on-demand snapshot 2026-11-29 (third-party); live list prices via "
             "`broker catalog refresh` (AWS Pricing API, needs AWS credentials)",
             "a note with [brackets] and [bold]markup-looking[/] text and a trailing backslash \\"]
    spot = option("vast", "simulated", [vast], worst=0.74, interruptible=True, expected=0.52)
    return {
        "basic": Plan(requirements=req(), options=[option("vast", "simulated", [vast], worst=0.39),
                                                   option("aws", "multi-node", [g4, g4], worst=1.24),
                                                   option("aws", "multi-node", [g4b, g4b], worst=1.24)],
                      rejected=rejected, notes=notes, valid_count=27),
        "interruptible": Plan(requirements=req(interruptible="auto"),
                              options=[spot, option("vast", "simulated", [vast], worst=0.39, expected=0.39)],
                              rejected=rejected[:2], notes=notes[:1]),
        "none valid": Plan(requirements=req(budget_usd=0.1), rejected=rejected * 4, notes=notes),
        "cpu only": Plan(requirements=req(gpus_per_node=0, cpu_ok=True, hours=None),
                         options=[option("local", "local", [], worst=0.0, max_h=None)], notes=["free tier: x"]),
        "long names": Plan(requirements=req(gpu_names=["A100 SXM4 80GB with a long name", "V100"]),
                           options=[option("gcp", "multi-node", [longname, longname], worst=43.0)],
                           rejected=rejected[2:3] * 3),
    }


def both(plan: Plan, width: int, **kw) -> tuple[str, str]:
    from broker.core.ui import _Console

    rich_file = io.StringIO()
    con = _Console(file=rich_file, width=width, highlight=False, soft_wrap=True, emoji=False)
    render_plan(plan, None, out=RichOut(con), **kw)
    plain_file = io.StringIO()
    render_plan(plan, None, out=PlainOut(plain_file, width=width), **kw)
    return rich_file.getvalue(), plain_file.getvalue()


@pytest.mark.parametrize("name", list(plans()))
@pytest.mark.parametrize("width", [24, 40, 60, 80, 100, 119, 120, 160, 250])
def test_plain_renderer_prints_what_rich_prints(name, width, monkeypatch):
    monkeypatch.delenv("BROKER_NO_WRAP", raising=False)
    for wide in (None, True, False):
        rich_text, plain_text = both(plans()[name], width, wide=wide)
        assert plain_text == rich_text, (name, width, wide)
        assert "rejected" in plain_text or not plans()[name].rejected


def test_plain_renderer_under_broker_no_wrap(monkeypatch):
    monkeypatch.setenv("BROKER_NO_WRAP", "1")
    rich_text, plain_text = both(plans()["basic"], 60)
    assert plain_text == rich_text
    assert any(len(x) > 100 for x in plain_text.splitlines())  # prose on one line


def test_text_rich_lays_out_differently_goes_to_rich(monkeypatch, capsys):
    """Wide characters, tabs and control characters are rich's to lay out: the plain renderer hands them over."""
    p = plans()["basic"]
    p.notes.append("vast: Qu\u00e9bec \u4e2d\u6587 and a\ttab")
    plain_file = io.StringIO()
    render_plan(p, None, out=PlainOut(plain_file, width=80))
    assert plain_file.getvalue() == ""  # not written by the plain renderer ...
    assert "Qu\u00e9bec" in capsys.readouterr().out  # ... but by rich, on stdout


def _random_table(rng: random.Random):
    from broker.core.plaintable import Column, Table

    def words() -> str:
        n = rng.choice([0, 1, 1, 2, 3, 6, 12])
        parts = ["".join(rng.choice("abcdefgh-./$") for _ in range(rng.choice([1, 2, 4, 7, 12, 30])))
                 for _ in range(n)]
        text = " ".join(parts)
        if rng.random() < 0.2 and text:
            text = text.replace(" ", "\n", 1)
        if rng.random() < 0.1:
            text = "  " + text + "  "
        return text

    cols = []
    for _ in range(rng.randint(1, 6)):
        cols.append(Column(words()[:12], justify=rng.choice(["left", "right"]), no_wrap=rng.random() < 0.4,
                           overflow=rng.choice(["fold", "ellipsis", "crop"]),
                           max_width=rng.choice([None, None, 5, 24])))
    t = Table(title=rng.choice([None, "title", "a longer title that will wrap " * 3]), columns=cols)
    for _ in range(rng.randint(0, 5)):
        t.add_row(*((words(), rng.random() < 0.3) for _ in cols))
    return t


def test_random_tables_match_rich_byte_for_byte(monkeypatch):
    """The table engine against rich itself: random columns (justify, no_wrap, overflow, max_width), cells (words
    longer than their column, several lines, word-wrapped or not) and widths, through print_table both ways."""
    from rich import box
    from rich.table import Table as RichTable

    from broker.core.plaintable import table_text
    from broker.core.ui import Wrapped, _Console, print_table

    monkeypatch.delenv("BROKER_NO_WRAP", raising=False)
    rng = random.Random(27)
    for i in range(400):
        t = _random_table(rng)
        width = rng.randint(1, 130)
        wide = rng.random() < 0.3
        rt = RichTable(title=t.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                       collapse_padding=True)
        for c in t.columns:
            rt.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow=c.overflow, max_width=c.max_width)
        for row in zip(*(c.cells for c in t.columns)):
            rt.add_row(*(Wrapped(x) if w else x for x, w in row))
        f = io.StringIO()
        print_table(rt, wide=wide, out=_Console(file=f, width=width, highlight=False, soft_wrap=True, emoji=False))
        assert table_text(t, width, width, wide=wide) == f.getvalue(), (i, width, wide, t)


@pytest.mark.parametrize("text", ["plain", "a [b] c", "[bold]x[/] y", "\\[bold] not a tag", "x\\", "x\\\\",
                                  "\\\\[bold]y[/]", "[link=https://x]u[/link]", "[1, 2]", "a[/]"[:1]])
def test_markup_and_escape_as_rich(text):
    from rich.markup import escape as rich_escape, render

    from broker.core.plaintable import escape, markup_plain

    assert escape(text) == rich_escape(text)
    for m in (text, rich_escape(text), f"[dim]note:[/] {rich_escape(text)}"):
        assert markup_plain(m) == render(m).plain


def test_a_terminal_or_forced_colour_is_rich_s(monkeypatch):
    from broker.core.plaintable import stream_is_plain

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    assert stream_is_plain(io.StringIO()) and not stream_is_plain(Tty())
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert not stream_is_plain(io.StringIO())
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert not stream_is_plain(io.StringIO())


def _env(tmp_path: Path, columns: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "VAST_", "OCI_", "GOOGLE_", "GCP_", "BROKER_", "FORCE_COLOR", "TTY_"))}
    env.update(BROKER_HOME=str(tmp_path / "h"), HOME=str(tmp_path), OCI_CONFIG_FILE=str(tmp_path / "no-oci"),
               AWS_EC2_METADATA_DISABLED="true", CLOUDSDK_CONFIG=str(tmp_path / "nogcloud"), COLUMNS=columns,
               PYTHONPATH=str(REPO))
    return env


#: runs `broker ARGS`; with RICH=1 rich's console is loaded first, so the plan prints through rich
PROG = ("import os, sys\nif os.environ.get('RICH') == '1':\n    import broker.core.ui\n"
        "from broker.cli.app import main\nsys.argv = ['broker'] + sys.argv[1:]\ntry:\n    main()\nfinally:\n"
        "    sys.stderr.write('RICH_LOADED=%d' % ('rich.console' in sys.modules))\n")


@pytest.mark.parametrize("args,columns", [(["--budget", "5"], "80"), (["--budget", "5"], "100"),
                                          (["--budget", "5", "--wide"], "60"),
                                          (["--budget", "5", "--nodes", "1", "--interruptible", "auto"], "80"),
                                          (["--budget", "0.1"], "80"), (["--budget", "5", "--cpu-only"], "40")])
def test_broker_plan_in_a_pipe_prints_rich_s_text_without_rich(tmp_path, args, columns):
    out = {}
    for rich in ("0", "1"):
        env = dict(_env(tmp_path, columns), RICH=rich)
        cp = subprocess.run([sys.executable, "-c", PROG, "plan", *args], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
        assert cp.returncode in (0, 3), cp.stderr
        err, loaded = cp.stderr.rsplit("RICH_LOADED=", 1)
        assert loaded == rich  # the plain run never imported rich's console
        out[rich] = (cp.returncode, cp.stdout, err)
    assert out["0"] == out["1"]
    assert "rented" in out["0"][1] or "no valid plan" in out["0"][2]


def test_broker_plan_with_gcp_configured_reads_quotas_without_the_cloud_clients(tmp_path):
    """GCP credentials and a project set (the emulator as the Compute endpoint): `broker plan` still reads the live
    quotas (regions.get, projects.get) and rejects what they do not allow, but through google-auth alone: no
    google.cloud client is imported (google-cloud-compute costs seconds)."""
    import json

    from tests.support.gcp_emulator import GCPEmulator

    adc = tmp_path / "gcloud"
    adc.mkdir()
    (adc / "application_default_credentials.json").write_text(json.dumps(
        {"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "t"}))
    code = ("import json, sys\nsys.argv = ['broker', 'plan', '--budget', '5', '--provider', 'gcp', '--json']\n"
            "from broker.cli.app import main\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
            "sys.stderr.write('MODS=' + json.dumps(sorted(m for m in sys.modules if m.startswith('google'))))\n")
    with GCPEmulator() as emu:
        emu.region_quotas["us-central1"]["NVIDIA_T4_GPUS"] = 0
        env = dict(_env(tmp_path, "100"), CLOUDSDK_CONFIG=str(adc), GOOGLE_CLOUD_PROJECT=emu.project,
                   GCP_COMPUTE_ENDPOINT=emu.url, GCP_QUOTAS_ENDPOINT=emu.url)
        cp = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
        journal = list(emu.journal)
    assert cp.returncode == 0, cp.stderr[-3000:]
    mods = json.loads(cp.stderr.rsplit("MODS=", 1)[1])
    assert "google.auth" in mods and not [m for m in mods if m.startswith(("google.cloud", "google.api_core"))], mods
    paths = [p for m, p, status in journal if status == 200]
    assert paths == ["/compute/v1/projects/broker-test/aggregated/acceleratorTypes",  # the zones offering each GPU
                     "/compute/v1/projects/broker-test/regions/us-central1", "/compute/v1/projects/broker-test"]
    plan = json.loads(cp.stdout)["plan"]
    t4 = [o for o in plan["rejected"] if "NVIDIA_T4_GPUS" in " ".join(o["rejected"])]
    assert t4, plan["rejected"]  # the live quota (0 T4 GPUs) rejected the T4 options
    assert all(o["offers"][0]["instance_type"] != "n1-standard-4+t4" for o in plan["options"])


def test_a_gcp_error_answer_without_the_client_is_the_same_broker_error(tmp_path, monkeypatch):
    """A 403 quota / rate-limit / 404 answer to the REST read maps as the client's errors map (api.translate)."""
    from broker.core.provider import AuthError, ProviderError, TransientError
    from broker.providers.gcp import GCPProvider
    from tests.support.gcp_emulator import GCPEmulator

    with GCPEmulator() as emu:
        monkeypatch.setenv("GCP_COMPUTE_ENDPOINT", emu.url)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", emu.project)
        api = GCPProvider().api
        assert api.get_json("regions.get", f"projects/{emu.project}/regions/us-central1")["name"] == "us-central1"
        with pytest.raises(ProviderError) as e:
            api.get_json("regions.get", f"projects/{emu.project}/regions/nowhere1")
        assert e.value.status == 404 and "regions.get" in str(e.value)
        emu.fail[("GET", "regions")] = [429]
        with pytest.raises(TransientError) as e:
            api.get_json("regions.get", f"projects/{emu.project}/regions/us-central1")
        assert e.value.status == 429
        emu.fail[("GET", "regions")] = [403]
        with pytest.raises(AuthError):
            api.get_json("regions.get", f"projects/{emu.project}/regions/us-central1")
