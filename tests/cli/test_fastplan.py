"""`broker plan` without Typer (broker.cli.fastplan): the same options, the same values, the same output and errors
as through the Typer app; whatever it does not parse is left to Typer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from broker.cli import fastplan

REPO = Path(__file__).resolve().parents[2]


def _plan_click_command():
    from broker.cli import app as cli

    return cli.command(cli.make_app(["broker.cli.planning"])).commands["plan"]


def test_the_option_table_is_the_typer_commands():
    """Every option of plan_cmd (and no other) is in OPTIONS, with its parameter, its kind and its default."""
    cmd = _plan_click_command()
    seen: set[str] = set()
    for p in cmd.params:
        if p.name == "help":
            continue
        opts = [*p.opts, *p.secondary_opts]
        seen.update(opts)
        for o in opts:
            assert o in fastplan.OPTIONS, o
            assert fastplan.OPTIONS[o][0] == p.name, o
        kind = fastplan.OPTIONS[p.opts[0]][1]
        if p.is_flag:
            assert isinstance(kind, bool) and kind is True, p.name
            for o in p.secondary_opts:
                assert fastplan.OPTIONS[o][1] is False
        elif p.multiple:
            assert kind == "list", p.name
        else:
            names = {"float": "float", "integer": "int", "int range": "int", "integer range": "int", "text": "str"}
            assert kind == names.get(p.type.name, "path" if "path" in p.type.name.lower() else p.type.name), (
                p.name, p.type.name)
        if getattr(p.type, "min", None) is not None:
            assert fastplan.MINIMUM[p.name] == p.type.min
    assert seen == set(fastplan.OPTIONS)
    assert set(fastplan.DEFAULTS) == {p.name for p in cmd.params if p.name != "help"}


@pytest.mark.parametrize("argv", [
    ["plan"],
    ["plan", "--budget", "5"],
    ["plan", "-b", "5", "--nodes", "3", "--gpus-per-node", "2", "--hours", "0.5"],
    ["plan", "--budget=5", "--json", "--no-cpu-ok", "--top", "3"],
    ["plan", "--gpu", "A10", "--gpu", "RTX 4090", "-p", "vast", "--provider", "aws", "--min-gpu-mem", "24"],
    ["plan", "--budget", "5", "--max-run", "--topology", "simulated", "--cpu-ok", "--wide", "--narrow"],
    ["plan", "--cpu-only", "--disk", "80", "--vast-query", "reliability>0.98", "--offline", "--budget", "1e3"],
    ["plan", "--budget", "inf", "--budget", "7"],  # given twice: the last one
    ["plan", "--gpu", "", "--topology", "nonsense", "--hours", " 2 "],
    ["-v", "plan", "--budget", "5"], ["-vv", "plan"], ["--verbose", "-v", "plan"],
])
def test_parse_gives_what_typer_passes(argv, monkeypatch, tmp_path):
    from broker.cli import app as cli
    from broker.cli import plan as plan_mod

    got: dict = {}
    monkeypatch.setattr(plan_mod, "plan_command", lambda **kw: got.update(kw) or 0)
    monkeypatch.setattr(cli, "root_verbose", lambda v: got.update(_verbose=v))
    rv = cli.command(cli.make_app(["broker.cli.planning"]))(args=list(argv), prog_name="broker", standalone_mode=False)
    assert rv in (0, None)
    verbose, kwargs = fastplan.parse(list(argv))
    assert got.pop("_verbose") == verbose
    assert kwargs == got
    assert {k: type(v) for k, v in kwargs.items()} == {k: type(v) for k, v in got.items()}


def test_a_recipe_path_is_a_path(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("x")
    assert fastplan.parse(["plan", "--recipe", str(r)])[1]["recipe"] == r
    assert fastplan.parse(["plan", "-r", str(tmp_path / "missing.yaml")])[1]["recipe"] == tmp_path / "missing.yaml"


@pytest.mark.parametrize("argv", [
    ["plan", "--help"], ["plan", "-h"], ["plan", "--budgt", "5"], ["plan", "-b5"], ["plan", "-b=5"],
    ["plan", "--json=yes"], ["plan", "--top", "0"], ["plan", "--budget"], ["plan", "--budget", "five"],
    ["plan", "--nodes", "2.5"], ["plan", "r.yaml"], ["plan", "--", "--budget"], ["plan", "--budget", "-5"],
    ["--version", "plan"], ["--json", "plan"], ["status"], [], ["run", "plan"], ["plan", "offers"],
    ["plan", "--gpu", "--json"],
])
def test_what_it_does_not_parse_is_left_to_typer(argv):
    assert fastplan.parse(argv) is None


def test_shell_completion_is_left_to_typer(monkeypatch):
    monkeypatch.setenv("_BROKER_COMPLETE", "complete_bash")
    assert fastplan.parse(["plan", "--budget", "5"]) is None


def test_an_unreadable_recipe_is_left_to_typer(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    r = tmp_path / "r.yaml"
    r.write_text("x")
    r.chmod(0)
    assert fastplan.parse(["plan", "--recipe", str(r)]) is None


def _broker(argv: list[str], home: Path, *, typer_only: bool) -> subprocess.CompletedProcess:
    """``broker ARGV`` through main(), with the parser-free start switched off for ``typer_only``."""
    code = ("import sys\nfrom broker.cli import app as cli, fastplan\n"
            + ("fastplan.parse = lambda args: None\n" if typer_only else "")
            + f"cli.main({argv!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VAST_", "OCI_", "BROKER_"))}
    env.update(PYTHONPATH=str(REPO), BROKER_HOME=str(home / "h"), HOME=str(home), COLUMNS="100",
               AWS_EC2_METADATA_DISABLED="true", OCI_CONFIG_FILE=str(home / "no-oci"),
               AWS_CONFIG_FILE=str(home / "no-aws"), AWS_SHARED_CREDENTIALS_FILE=str(home / "no-aws-creds"))
    return subprocess.run([sys.executable, "-c", code], cwd=home, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("argv", [
    ["plan", "--budget", "5"],
    ["plan", "--budget", "5", "--wide", "--top", "3"],
    ["plan", "--budget", "0.01"],  # no valid plan: exit 3
    ["plan", "--budget", "0.01", "--json"],
    ["plan", "--budget", "5", "--cpu-only"],
    ["plan", "--max-run", "--hours", "1"],  # bad input: exit 2, broker's message
    ["plan", "--budget", "nan"],
    ["-v", "plan", "--budget", "5", "--json", "--provider", "oci"],
    ["plan", "--recipe", "missing.yaml"],
])
def test_output_and_exit_code_are_the_typer_paths(argv, tmp_path):
    fast = _broker(argv, tmp_path, typer_only=False)
    slow = _broker(argv, tmp_path, typer_only=True)
    assert fast.returncode == slow.returncode, (fast.stderr, slow.stderr)

    def no_times(text: str) -> list[str]:  # -v log lines start with a timestamp; --json has the plan's time
        text = re.sub(r"\d{4}-\d\d-\d\d[T ][\d:.,]+Z?", "TIME", text)
        return text.splitlines()

    assert no_times(fast.stdout) == no_times(slow.stdout)
    assert no_times(fast.stderr) == no_times(slow.stderr)
    if "--json" in argv:
        assert json.loads(fast.stdout)["schema_version"] == 1


def test_plan_imports_no_typer(tmp_path):
    code = ("import json, sys\nfrom broker.cli import app as cli\ntry:\n    cli.main(['plan', '--budget', '5'])\n"
            "except SystemExit:\n    pass\nsys.stderr.write('MODS=' + json.dumps(sorted(sys.modules)) + '\\n')")
    env = dict(os.environ, PYTHONPATH=str(REPO), BROKER_HOME=str(tmp_path / "h"), COLUMNS="100")
    cp = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=120)
    mods = set(json.loads([ln for ln in cp.stderr.splitlines() if ln.startswith("MODS=")][-1][5:]))
    assert "broker.plan.planner" in mods  # it planned
    # shutil and base64 (with zlib, bz2, lzma) are loaded only where something is copied or launched
    for heavy in ("typer", "click", "typer.main", "broker.run.hybrid", "configparser", "shutil", "base64"):
        assert heavy not in mods, heavy


def test_a_typo_still_gets_typers_suggestion(tmp_path):
    cp = _broker(["plan", "--budgt", "5"], tmp_path, typer_only=False)
    assert cp.returncode == 2 and "--budget" in cp.stderr
