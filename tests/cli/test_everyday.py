"""Everyday commands as a user of SkyPilot / dstack expects them: a detached run that prints its id and how to
follow it, `logs` of the latest run, a status that names runs within 80 columns, one error style for usage
errors with did-you-mean, and recipe messages that are sentences."""

from __future__ import annotations

import json
import re
import os
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.money.ledger import Ledger
from tests.conftest import REPO, broker_cmd

TICKER = """
import os, time
rank = int(os.environ["RANK"])
for i in range(int(os.environ.get("TICKS", "3"))):
    print(f"rank {rank} tick {i}", flush=True)
    time.sleep(float(os.environ.get("TICK_S", "0.2")))
print(f"rank {rank} LAST_LINE", flush=True)
"""


def _cli(args, env, timeout=240, **kw):
    return subprocess.run(broker_cmd(*args), cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, **kw)


def _ticker(tmp_path: Path, extra: str = "") -> Path:
    d = tmp_path / "my recipes"  # a space: the printed commands must stay copyable
    d.mkdir(exist_ok=True)
    (d / "ticker.py").write_text(TICKER)
    (d / "r.yaml").write_text("name: ticker\nscript: ticker.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n" + extra)
    return d / "r.yaml"


def _detached_id(p) -> str:
    """The run id `broker run -d` printed (its first line: ``run ID: name, starting in the background``)."""
    m = re.search(r"^run (\S+): ", p.stdout, re.M)
    assert m, p.stdout
    return m.group(1)


def _wait_row(run_id: str, timeout: float = 90):
    """The run's ledger row, once the background process has written it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        run = Ledger().get_run(run_id)
        if run is not None:
            return run
        time.sleep(0.2)
    raise AssertionError(f"run {run_id} has no row")


def _wait_ended(run_id: str, timeout: float = 90) -> str:
    from broker.money.accounting import ACTIVE_STATUSES

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        run = Ledger().get_run(run_id)
        if run is not None and run.status not in ACTIVE_STATUSES:
            return run.status
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} did not end")


def test_run_detached_returns_with_the_id_and_logs_latest_follows_it(cli_env, tmp_path):
    env = dict(cli_env, TICKS="10", TICK_S="0.5")
    t0 = time.monotonic()
    p = _cli(["run", "-d", str(_ticker(tmp_path))], env)
    assert p.returncode == 0, p.stderr
    run_id = _detached_id(p)
    _wait_row(run_id)
    for cmd in (f"broker logs -f {run_id}", f"broker status {run_id}", f"broker down {run_id}"):
        assert cmd in p.stdout
    back = time.monotonic() - t0
    run = Ledger().get_run(run_id)
    assert run.status == "running" and run.pid != os.getpid()  # still going, driven by another process
    f = _cli(["logs", "-f"], env, timeout=120)  # latest by default
    assert f.returncode == 0, f.stderr
    assert "rank 0 tick 0" in f.stdout and "rank 0 LAST_LINE" in f.stdout
    assert _wait_ended(run_id) == "succeeded"
    assert back < time.monotonic() - t0  # it came back before the run ended
    again = _cli(["logs", "latest", "--node", "1"], env)
    assert again.returncode == 0 and "rank 1 LAST_LINE" in again.stdout


def test_run_detached_prints_every_line_on_stdout_and_returns(cli_env, tmp_path):
    """`broker run -d R > file`: the last line ("output: ...") came on stderr, apart from the rest, after the
    command had returned; stdout must carry every line, newline-terminated, when the parent exits."""
    env = dict(cli_env, TICKS="20", TICK_S="0.5")
    p = _cli(["run", "-d", str(_ticker(tmp_path))], env)
    assert p.returncode == 0, p.stderr
    run_id = _detached_id(p)
    _wait_row(run_id)
    assert p.stdout.endswith("\n") and "output:" in p.stdout.splitlines()[-1], p.stdout
    assert "output:" not in p.stderr, p.stderr
    assert _wait_ended(run_id) == "succeeded"


def test_logs_follow_ends_with_the_runs_state_and_latest_is_taken_by_every_run_argument(cli_env, tmp_path):
    """`broker logs -f latest` on a failed run printed no final state; `broker ssh latest` said "no run 'latest'"."""
    r = _ticker(tmp_path, "")
    (r.parent / "ticker.py").write_text(TICKER + "raise SystemExit(3)\n")
    p = _cli(["run", str(r), "-q"], cli_env)
    assert p.returncode == 1, p.stdout + p.stderr
    run_id = Ledger().list_runs()[0].id
    f = _cli(["logs", "-f", "latest"], cli_env)
    assert f.returncode == 0 and "rank 0 LAST_LINE" in f.stdout, f.stdout + f.stderr
    assert re.search(rf"run {run_id} failed", f.stderr), f.stderr
    for args in (["ssh", "latest"], ["exec", "latest", "--", "hostname"], ["status", "latest"],
                 ["down", "latest"]):
        q = _cli(args, cli_env)
        assert "no run 'latest'" not in q.stderr, (args, q.stderr)
        assert run_id in q.stdout + q.stderr, (args, q.stdout, q.stderr)


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["from-a-terminal", "from-a-script-background-job"])
def test_down_interrupts_a_detached_run(cli_env, tmp_path, sigint_ignored):
    """Also when `broker run -d` was started where SIGINT is ignored (`broker run -d ... &` in a script: the
    background process inherits the ignored SIGINT, and `broker down` interrupts it with SIGINT)."""
    import signal

    env = dict(cli_env, TICKS="200", TICK_S="0.5")
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if sigint_ignored else None
    try:
        p = _cli(["run", "--detach", str(_ticker(tmp_path))], env)
    finally:
        if sigint_ignored:
            signal.signal(signal.SIGINT, before)
    assert p.returncode == 0, p.stderr
    run = _wait_row(_detached_id(p))
    t0 = time.monotonic()
    while not (Path(run.run_dir) / "detached.json").exists() and time.monotonic() - t0 < 60:
        time.sleep(0.2)  # `broker down` interrupts a background process that has marked its folder
    d = _cli(["down", run.id], env, timeout=180)
    assert d.returncode == 0, d.stdout + d.stderr
    assert "interrupted" in d.stdout
    assert _wait_ended(run.id, timeout=30) in ("interrupted", "failed")
    from broker.money.accounting import pid_alive

    assert not pid_alive(run.pid)
    ended = Ledger().get_run(run.id)  # it was `broker down`, not a Ctrl-C nobody pressed
    assert "Ctrl-C" not in (ended.message or "") and "broker down" in (ended.message or ""), ended.message


def test_run_detached_that_cannot_start_says_why_in_the_foreground(cli_env, tmp_path):
    p = _cli(["run", "-d", str(_ticker(tmp_path)), "--provider", "fake"], cli_env)  # paid, no --yes, no terminal
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--yes" in p.stderr and not Ledger().list_runs()


def test_run_detached_returns_before_the_background_process_has_written_its_row(cli_env, tmp_path):
    """`broker run -d` waited about 5 s for the background process's ledger row; the parent now chooses the id and
    returns at once: here the ledger's write lock is held throughout, so no row can have been written."""
    import sqlite3

    from broker.core.config import ledger_path

    env = dict(cli_env, TICKS="2", TICK_S="0.1")
    Ledger().close()
    lock = sqlite3.connect(ledger_path(), isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")  # every ledger write (the background run's first row) waits for this
    try:
        p = _cli(["run", "-d", str(_ticker(tmp_path))], env, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        run_id = _detached_id(p)
        assert f"broker logs -f {run_id}" in p.stdout
        assert lock.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0  # returned before any row
        # a reader does not wait for the writer; the line fits 80 columns (it ran to 130)
        s = _cli(["status", "--no-refresh"], dict(env, COLUMNS="80", BROKER_NO_WRAP="0"), timeout=60)
        assert f"run {run_id} (ticker): starting in the background" in " ".join(s.stdout.split()), \
            s.stdout + s.stderr
        assert max(len(line) for line in s.stdout.splitlines()) <= 80, s.stdout
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert _wait_ended(run_id) == "succeeded"  # the run then went on with the id the parent printed
    assert not list((Path(cli_env["BROKER_HOME"]) / "starting").glob("*.json"))


def test_a_detached_run_that_dies_at_start_is_reported_by_status_and_logs(cli_env, tmp_path):
    from broker.cli import starting

    # --cluster without --provider slurm passes the parent and is refused by the background process at once
    p = _cli(["run", "-d", str(_ticker(tmp_path)), "--cluster", "c1"], cli_env)
    assert p.returncode == 0, p.stdout + p.stderr
    run_id = _detached_id(p)
    t0 = time.monotonic()
    while any(d["alive"] for d in starting.entries()) and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    s = _cli(["status", "--no-refresh"], cli_env)
    flat = " ".join(s.stdout.split())
    assert f"run {run_id} (ticker): did not start" in flat and "--provider slurm" in flat, s.stdout
    for args in (["logs", run_id], ["logs", "-f"], ["status", run_id]):
        q = _cli(args, cli_env)
        assert q.returncode == 1, (args, q.stdout, q.stderr)
        assert "ended before it started" in q.stderr and "--cluster works with --provider" in q.stderr, q.stderr


def test_logs_without_any_run_says_so(cli_env):
    p = _cli(["logs"], cli_env)
    assert p.returncode == 2 and "no runs yet" in p.stderr


def test_status_names_runs_within_80_columns(tmp_path, monkeypatch):
    from broker.core import ui
    from broker.cli.app import app
    from tests.support.watchdog_helpers import make_run

    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.setattr(ui.console, "_width", 80)
    led = Ledger(tmp_path / "ledger.sqlite")
    make_run(led, budget_usd=5.0)
    for name, prov, topo in (("gpt-small-finetune", "vast", "simulated"), ("resnet", "oci", "multi-node")):
        r = make_run(led, budget_usd=5.0)
        led.update_run(r.id, name=name, provider=prov, topology=topo, status="succeeded")
    res = CliRunner().invoke(app, ["status", "--no-refresh"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(x) for x in lines) <= 80, res.output
    text = res.output.replace("\n", " ")
    for word in ("gpt-small", "resnet", "vast", "simulated", "oci", "multi-node", "succeeded", "name", "where"):
        assert word in text, res.output


# ------------------------------------------------------------------------------------------------ one error style
def _main(args, capsys):
    from broker.cli import app as cli
    with pytest.raises(SystemExit) as ex:
        cli.main(args)
    out = capsys.readouterr()
    return ex.value.code, out.out, " ".join(out.err.split())


@pytest.mark.parametrize("args, needles", [
    (["plan", "--budget", "abc"], ["error: Invalid value for '--budget'", "-> usage: broker plan [OPTIONS]"]),
    (["run"], ["error: Missing argument 'RECIPE|SCRIPT.py'", "usage: broker run [OPTIONS] RECIPE|SCRIPT.py"]),
    (["launch", "r.yaml"], ["error: no command 'launch'", "did you mean `broker run`?"]),
    (["plan", "r.yaml"], ["the recipe goes after --recipe: broker plan --recipe r.yaml"]),
    (["plan", "--provider", "vasti"], ["--provider 'vasti' is not a provider", "did you mean --provider vast?"]),
    (["plan", "--topology", "multinode"], ["did you mean --topology multi-node?", "simulated, multi-node"]),
    (["run", "r.yaml", "--mesh=wireguad"], ["did you mean --mesh wireguard?"]),
])
def test_usage_errors_print_broker_style_with_did_you_mean(args, needles, capsys, broker_home):
    code, out, err = _main(args, capsys)
    assert code == 2, err
    assert "Usage:" not in err and "Try 'broker" not in err, err
    assert err.startswith("error: ") and " -> " in err, err
    for n in needles:
        assert n in err, err


def test_enum_flags_accept_another_case(capsys, broker_home):
    code, out, err = _main(["plan", "--provider", "LOCAL", "--topology", "Simulated", "--nodes", "2", "--cpu-ok",
                            "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["chosen"]["provider"] == "local", out


def test_ssh_words_after_the_run_are_not_checked():
    from broker.core.choices import normalize_args

    assert normalize_args(["ssh", "RUN", "--", "ls", "-p", "X"]) == ["ssh", "RUN", "--", "ls", "-p", "X"]
    assert normalize_args(["slurm", "submit", "-p", "gpu"]) == ["slurm", "submit", "-p", "gpu"]
    assert normalize_args(["run", "r.yaml", "-p", "Vast", "--", "--provider", "x"])[3] == "vast"


# ------------------------------------------------------------------------------------------- recipe messages
def _recipe(tmp_path: Path, body: str) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    p = tmp_path / "r.yaml"
    p.write_text(body)
    return p


def test_setup_expect_and_artifacts_take_one_text_as_skypilot_does(tmp_path):
    from broker.core.recipe import load_recipe

    r = load_recipe(_recipe(tmp_path, "name: j\nscript: train.py\nsetup: echo hi\nexpect: out.txt\n"
                                      "artifacts: '*.pt'\n"))
    assert r.setup == ["echo hi"] and r.expect == ["out.txt"] and r.artifacts == ["*.pt"]
    block = load_recipe(_recipe(tmp_path, "name: j\nscript: train.py\nsetup: |\n  pip list\n  echo done\n"))
    assert block.setup == ["pip list\necho done\n"]  # a block is one shell script


@pytest.mark.parametrize("body, needles, not_in", [
    ("name: j\nscript: train.py\nbudget_usd: 1e12\n",
     ["field 'budget_usd'", "1000000000000 is more than the largest allowed, 100000"], ["valid number"]),
    ("name: j\nscript: train.py\nmax_hours: 0\n", ["0 is too small: it must be more than 0"], ["Input should"]),
    ("name: j\nscript: .\n", ["field 'script'", "is a folder", "must name the training script"], ["outside"]),
    ("name: tické\nscript: train.py\n", ["field 'name'", "'é' is not allowed in a name"], ["^[A-Za-z", "pattern"]),
    ("name: -x\nscript: train.py\n", ["must start with a letter or digit, not '-'"], ["pattern"]),
])
def test_recipe_errors_are_sentences(tmp_path, body, needles, not_in):
    from broker.core.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError) as ei:
        load_recipe(_recipe(tmp_path, body))
    text = " ".join(f"{ei.value.message} {ei.value.hint or ''}".split())
    for n in needles:
        assert n in text, text
    for n in not_in:
        assert n not in text, text


def test_exponent_budget_within_bounds_is_a_number(tmp_path):
    from broker.core.recipe import load_recipe

    assert load_recipe(_recipe(tmp_path, "name: j\nscript: train.py\nbudget_usd: 2.5e1\n")).budget_usd == 25.0


# ------------------------------------------------------------------------------------------- copyable commands
def test_kept_nodes_ssh_command_is_one_quoted_line():
    import shlex
    from types import SimpleNamespace as NS

    from broker.cli.lifecycle import kept_message

    node = NS(user="root", host="203.0.113.7", port=2222)
    cluster = NS(nodes=[node], local_exec=False, ssh_key_path="/home/me/my keys/id_ed25519", workroot="/root/work")
    out = NS(run=NS(id="r-1"), kept=[NS(provider="vast", provider_id="123", name="n0")], cluster=cluster)
    lines = kept_message(out, 10)
    ssh = next(x for x in lines if "ssh into node 0" in x)
    from broker.cli.lifecycle import commands_in

    assert commands_in(ssh)[0] == "broker ssh r-1"
    assert shlex.split(commands_in(ssh)[1]) == ["ssh", "-i", "/home/me/my keys/id_ed25519", "-p", "2222",
                                                "root@203.0.113.7"]
    cluster.known_hosts_path = "/home/me/runs/r-1/known hosts"  # the run's pinned key travels with the command
    ssh = next(x for x in kept_message(out, 10) if "ssh into node 0" in x)
    assert shlex.split(commands_in(ssh)[1]) == ["ssh", "-i", "/home/me/my keys/id_ed25519", "-o",
                                                "UserKnownHostsFile=/home/me/runs/r-1/known hosts", "-p", "2222",
                                                "root@203.0.113.7"]
    node.resource_id = "r-9f"  # a rented machine's key is pinned under its resource id, not its address
    ssh = next(x for x in kept_message(out, 10) if "ssh into node 0" in x)
    assert "-o HostKeyAlias=broker-res-r-9f" in commands_in(ssh)[1]
    assert "(recipe idle_minutes=10)" in lines[0]
    assert "(--idle-minutes 10)" in kept_message(out, 10, "--idle-minutes 10")[0]  # what the user typed


def test_hints_quote_recipe_paths_with_spaces(tmp_path, capsys, broker_home):
    (tmp_path / "my dir").mkdir()
    p = _recipe(tmp_path / "my dir", "name: j\nscript: train.py\nnodes: 2\ncpu_ok: true\n")
    code, out, err = _main(["run", str(p), "--inject", "firewall"], capsys)
    assert code == 2, err
    import shlex

    assert f"broker run {shlex.quote(str(p))} --provider netns" in err, err


# ------------------------------------------------------------------------------------------- quiet backends
def _fatal_slurm(tmp_path: Path, monkeypatch) -> None:
    """Slurm commands that exist but reach no controller (a machine with the binaries and no cluster)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for cmd in ("squeue", "sinfo", "sacct", "scontrol", "sbatch", "scancel"):
        (bin_dir / cmd).write_text("#!/bin/sh\necho \"$0: fatal: Could not establish a configuration source\" >&2\n"
                                   "echo \"$0: fatal: second line\" >&2\nexit 1\n")
        (bin_dir / cmd).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_slurm_with_nothing_live_is_not_asked_and_status_stays_quiet(tmp_path, monkeypatch):
    from broker.core import ui
    from broker.cli.app import app
    from broker.money.watchdog import Watchdog
    from tests.support.watchdog_helpers import make_run

    monkeypatch.setenv("BROKER_HOME", str(tmp_path))
    monkeypatch.setattr(ui.console, "_width", 80)
    _fatal_slurm(tmp_path, monkeypatch)
    led = Ledger(tmp_path / "ledger.sqlite")
    run = make_run(led, status="succeeded")
    res = led.record_intent(run.id, "slurm", "slurm_job", "job")
    led.mark_created(res.id, "123", state="running")
    led.update_resource(res.id, state="terminated")
    wd = Watchdog(led, home=tmp_path, orphan_scan_s=0)
    wd.run_once()
    assert "slurm" not in wd.errors, wd.errors
    wd.write_heartbeat()
    out = CliRunner().invoke(app, ["status", "--no-refresh"]).output
    assert "squeue" not in out and "fatal" not in out, out


def test_status_shows_a_backend_error_only_when_it_holds_something_live():
    from broker.cli.status import _watchdog_line

    wd = {"alive": True, "pid": 1, "age_s": 1.0,
          "errors": {"slurm": "slurm: list_tagged failed: squeue: fatal: a\nsqueue: fatal: b", "vast": "vast: 500"}}
    quiet = _watchdog_line(wd, set())
    assert "squeue" not in quiet and "vast: 500" in quiet
    loud = _watchdog_line(wd, {"slurm"})
    assert loud.count("squeue: fatal") == 1  # one line, not the backend's whole stderr


def test_reconcile_that_cannot_list_never_says_no_orphans(tmp_path, monkeypatch, fake_cloud):
    from broker.cli.app import app

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    monkeypatch.setenv("BROKER_FAKE_FAIL", "list")
    r = CliRunner().invoke(app, ["reconcile", "--provider", "fake"])
    assert r.exit_code == 4, r.output
    assert "no orphans." not in r.output and "unknown at fake" in r.output and "could not be listed" in r.output


# ------------------------------------------------------------------------------------------- --vast-query offline
@pytest.mark.parametrize("offline", [False, True])
def test_vast_query_is_honoured_against_the_snapshot_or_refused(offline, broker_home, capsys):
    extra = ["--offline"] if offline else []
    base = ["plan", "--provider", "vast", "--nodes", "2", "--json", *extra]
    code, out, err = _main([*base, "--vast-query", "garbage!!"], capsys)
    assert code == 2 and "garbage!!" in err, err
    code, out, err = _main([*base, "--vast-query", "reliability>0.98 num_gpus>=2"], capsys)
    assert code == 2 and "reliability cannot be checked without a Vast API key" in err, err
    code, out, err = _main(base, capsys)
    assert code == 0, err
    everything = json.loads(out)
    code, out, err = _main([*base, "--vast-query", "num_gpus>=4"], capsys)
    assert code == 0, err
    filtered = json.loads(out)
    opts = filtered["plan"]["options"]
    assert opts and all(o["offers"][0]["gpu_count"] >= 4 for o in opts), opts
    assert len(opts) < len(everything["plan"]["options"])


def test_offers_for_local_lists_this_machine(broker_home, capsys, monkeypatch):
    from broker.providers.local import LocalProvider

    monkeypatch.setattr(LocalProvider, "gpus", property(lambda self: []))  # a machine without GPU (as CI)
    code, out, err = _main(["offers", "--provider", "local", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["total"] == 1 and data["offers"][0]["provider"] == "local", data
    assert any("no GPU" in n for n in data["notes"])


# ------------------------------------------------------------------------------------------- terminal noise
def test_c10d_hostname_noise_and_empty_node_lines_stay_off_the_terminal(tmp_path, capsys, broker_home):
    from broker.core.ui import echo_node_line, is_terminal_noise

    noise = ("[node 1] [W1201 21:00:00 socket.cpp:752] [c10d] The hostname of the client socket cannot be "
             "retrieved. err=-3")
    assert is_terminal_noise(noise) and is_terminal_noise("[node 0] ") and is_terminal_noise("[node 3]")
    assert not is_terminal_noise("[node 0] step 1 loss 0.5") and not is_terminal_noise("[broker] ")
    for line in (noise, "[node 0] ", "[node 0] step 1 loss 0.5"):
        echo_node_line(line)
    out = capsys.readouterr().out
    assert "step 1 loss 0.5" in out and "hostname of the client socket" not in out
    assert "[node 0] \n" not in out and out.count("[node") == 1


def test_noise_is_left_out_of_streamed_blocks_too(capsys, broker_home):
    """The run's stream hands the console whole blocks of a node's lines: the same lines stay off the terminal."""
    from broker.core.ui import echo_node_line

    echo_node_line.block("[node 1] ", "step 1\n\n[c10d] The hostname of the client socket cannot be retrieved. "
                                      "err=-3\n   \nstep 2\n")
    echo_node_line.block("[node 0] ", "\n\n")
    out = capsys.readouterr().out
    assert out == "[node 1] step 1\n[node 1] step 2\n", repr(out)


def test_a_run_keeps_noise_in_the_node_log_but_not_on_the_terminal(cli_env, tmp_path):
    d = tmp_path / "noisy"
    d.mkdir()
    (d / "noisy.py").write_text("import sys\nprint('', flush=True)\nprint('[c10d] The hostname of the client socket "
                                "cannot be retrieved. err=-3', file=sys.stderr, flush=True)\nprint('REAL_LINE')\n")
    (d / "r.yaml").write_text("name: noisy\nscript: noisy.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n")
    p = _cli(["run", str(d / "r.yaml")], cli_env)
    assert p.returncode == 0, p.stderr
    term = p.stdout + p.stderr
    assert "[node 0] REAL_LINE" in term and "hostname of the client socket" not in term
    assert "[node 0] \n" not in term and not any(x.strip() in ("[node 0]", "[node 1]") for x in term.splitlines())
    run = Ledger().list_runs()[0]
    log = (Path(run.run_dir) / "node0.log").read_text()
    assert "hostname of the client socket" in log


# ------------------------------------------------------------------------------------------- staging what is named
def _ignored_scratch(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "scratch" / "conf").mkdir(parents=True)
    (repo / ".git").mkdir()  # a git work tree (git_top looks for .git)
    (repo / ".gitignore").write_text("scratch/\n")
    (repo / "scratch" / "ticker.py").write_text(TICKER)
    (repo / "scratch" / "conf" / "c.yaml").write_text("a: 1\n")
    (repo / "scratch" / "notes.txt").write_text("not named\n")
    (repo / "scratch" / ".env").write_text("SECRET=1\n")
    (repo / "scratch" / "r.yaml").write_text("name: ticker\nscript: ticker.py\nargs: [--config, conf/c.yaml, "
                                             "--env=.env]\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n")
    return repo / "scratch"


def test_named_files_are_staged_although_the_enclosing_repo_ignores_the_folder(tmp_path):
    from broker.run.staging import recipe_files, stage_plan

    d = _ignored_scratch(tmp_path)
    keep = recipe_files(d, "ticker.py", ["--config", "conf/c.yaml", "--env=.env", "--epochs", "3"])
    assert keep == ["ticker.py", "conf/c.yaml", ".env"]
    assert stage_plan(d).files == []  # the rule as it was: 0 files
    plan = stage_plan(d, keep=keep)
    assert sorted(f.as_posix() for f in plan.files) == ["conf/c.yaml", "ticker.py"]  # never .env (a secret)
    assert plan.forced["ticker.py"] == f"scratch/ in {tmp_path / 'repo' / '.gitignore'}"
    assert "ticker.py (scratch/ in" in plan.summary() and "notes.txt" in plan.summary()


def test_a_run_from_an_ignored_folder_stages_its_script(cli_env, tmp_path):
    d = _ignored_scratch(tmp_path)
    p = _cli(["run", str(d / "r.yaml")], dict(cli_env, TICKS="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "staged 2 file(s)" in p.stdout + p.stderr and "rank 0 LAST_LINE" in p.stdout


# ------------------------------------------------------------------------------------------- dpkg's lock
def test_scripts_test_waits_for_dpkgs_lock_with_a_limit_and_a_message(tmp_path):
    import sys

    lock = tmp_path / "lock-frontend"
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock)!r}, os.O_RDWR)\nfcntl.lockf(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True)\nsys.stdin.read()\n"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = dict(os.environ, BROKER_APT_LOCKS=f"{tmp_path / 'absent'} {lock}")
        late = subprocess.run([str(REPO / "scripts" / "apt-lock-wait"), "1"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert late.returncode == 1, late.stderr
        assert f"held by process {holder.pid}" in late.stderr and "BROKER_APT_LOCK_TIMEOUT" in late.stderr
        waiting = subprocess.Popen([str(REPO / "scripts" / "apt-lock-wait"), "120"], env=env, text=True,
                                   stderr=subprocess.PIPE)
        assert "waiting up to 120 s" in waiting.stderr.readline()
        holder.stdin.close()  # the holder ends: its lock goes
        holder.wait(timeout=30)
        assert waiting.wait(timeout=60) == 0
        assert "is free after" in waiting.stderr.read()
    finally:
        if holder.poll() is None:
            holder.kill()
    free = subprocess.run([str(REPO / "scripts" / "apt-lock-wait"), "1"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert free.returncode == 0 and free.stderr == ""
    assert "apt-lock-wait" in (REPO / "scripts" / "test").read_text()


# ------------------------------------------------------------------------------------------- netns up
def test_netns_up_above_8_nodes_asks_and_refuses_without_a_terminal(cli_env):
    p = _cli(["netns", "up", "9"], cli_env)
    assert p.returncode == 2 and "--yes" in p.stderr and "nothing was created" in p.stderr, p.stderr
    assert not Ledger().list_runs()


@pytest.mark.netns
def test_netns_up_is_a_run_in_the_ledger_with_a_deadline_the_watchdog_enforces(cli_env):
    from tests.conftest import netns_missing

    why = netns_missing()
    if why:
        pytest.skip(why)
    from datetime import timedelta

    from tests.support.clock import FakeClock
    from broker.providers import netns
    from broker.providers.netns import NetnsProvider
    from broker.money.watchdog import Watchdog

    p = _cli(["netns", "up", "2", "--hours", "0.5", "--json"], cli_env, timeout=120)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    cid, run_id = data["cid"], data["run_id"]
    try:
        led = Ledger()
        run = led.get_run(run_id)
        rows = led.resources(run_id, live_only=True)
        assert run.status == "running" and run.deadline is not None and len(rows) == 2
        assert {r.provider_id for r in rows} == {f"{cid}:0", f"{cid}:1"} and all(r.deadline for r in rows)
        st = _cli(["status", "--no-refresh"], cli_env)
        assert run_id in st.stdout and "netns" in st.stdout
        clock = FakeClock(run.deadline + timedelta(seconds=5))
        Watchdog(led, providers={"netns": NetnsProvider()}, clock=clock).run_once()
        assert not netns.leftovers(cid)
        assert not led.resources(run_id, live_only=True)
        # a second one, removed by hand: its run ends
        p2 = _cli(["netns", "up", "2", "--json"], cli_env, timeout=120)
        assert p2.returncode == 0, p2.stderr
        d2 = json.loads(p2.stdout)
        assert _cli(["netns", "down", d2["cid"]], cli_env, timeout=120).returncode == 0
        assert Ledger().get_run(d2["run_id"]).status == "torn_down"
        assert not Ledger().resources(d2["run_id"], live_only=True)
    finally:
        netns.remove_cid(cid)


# ------------------------------------------------------------------------------------------- --idle-minutes
def test_idle_minutes_on_the_command_line_overrides_the_recipe(cli_env, tmp_path):
    r = _ticker(tmp_path, "idle_minutes: 30\n")
    bad = _cli(["run", str(r), "--idle-minutes", "-1"], cli_env)
    assert bad.returncode == 2 and "--idle-minutes" in bad.stderr and "minutes" in bad.stderr, bad.stderr
    p = _cli(["run", str(r), "--idle-minutes", "5", "--json", "-q"], dict(cli_env, TICKS="1"))
    assert p.returncode == 0, p.stderr
    run = Ledger().get_run(json.loads(p.stdout)["run"]["id"])
    assert run.recipe["idle_minutes"] == 5


# ------------------------------------------------------------------------------------------- ssh --config --install
def test_ssh_config_install_includes_brokers_file_once_with_a_backup(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace as NS

    from broker.cli.day2 import install_ssh_config, ssh_config

    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "my home"))
    node = NS(node_rank=0, host="198.18.0.9", user="root", port=2222, local=False)
    cluster = NS(nodes=[node], ssh_key_path=str(tmp_path / "my keys" / "id"), known_hosts_path=None)
    user = tmp_path / "dot-ssh" / "config"
    user.parent.mkdir()
    user.write_text("Host work\n  HostName 192.0.2.1\n")
    own, where, backup = install_ssh_config("r-1", ssh_config("r-1", cluster), user_config=user)
    assert where == user and backup == user.with_name("config.broker-backup")
    assert backup.read_text() == "Host work\n  HostName 192.0.2.1\n"
    text = user.read_text()
    assert text.index("Include") < text.index("Host work") and text.count("Include") == 1
    assert oct(own.stat().st_mode & 0o777) == "0o600"
    again = install_ssh_config("r-1", ssh_config("r-1", cluster), user_config=user)
    assert again[2] is None and user.read_text() == text  # idempotent
    install_ssh_config("r-2", ssh_config("r-2", cluster), user_config=user)
    assert own.read_text().count("Host broker-r-1-n0") == 1 and "Host broker-r-2-n0" in own.read_text()
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client")
    g = subprocess.run(["ssh", "-G", "-F", str(user), "broker-r-1-n0"], capture_output=True, text=True, timeout=30)
    assert g.returncode == 0, g.stderr
    conf = dict(line.split(" ", 1) for line in g.stdout.splitlines() if " " in line)
    assert conf["hostname"] == "198.18.0.9" and conf["port"] == "2222" and conf["user"] == "root"
    assert str(tmp_path / "my keys" / "id") in g.stdout
    assert subprocess.run(["ssh", "-G", "-F", str(user), "work"], capture_output=True, text=True,
                          timeout=30).stdout.count("hostname 192.0.2.1") == 1


def test_the_broker_home_inside_the_work_folder_is_never_staged(tmp_path, monkeypatch):
    from broker.run.staging import BROKER_HOME_RULE, stage_plan

    work = tmp_path / "proj"
    (work / "home" / "runs").mkdir(parents=True)
    (work / "home" / "ledger.sqlite").write_text("")
    (work / "train.py").write_text("print(1)\n")
    monkeypatch.setenv("BROKER_HOME", str(work / "home"))
    plan = stage_plan(work)
    assert [f.as_posix() for f in plan.files] == ["train.py"]
    assert plan.excluded["home/"] == BROKER_HOME_RULE


def test_a_detached_run_whose_work_folder_holds_the_home_records_its_end(cli_env, tmp_path):
    """Staging the live ledger's files closed them in the running CLI, which drops its SQLite (POSIX) locks: the
    parent's exit then checkpointed the WAL away and the run's end was lost (it stayed `running`)."""
    r = _ticker(tmp_path)
    env = dict(cli_env, BROKER_HOME=str(r.parent / "home"), TICKS="4", TICK_S="0.3")
    p = _cli(["run", "-d", str(r)], env)
    assert p.returncode == 0, p.stderr
    assert _cli(["status", "--no-refresh"], env).returncode == 0
    _wait_row_in = Ledger(r.parent / "home" / "ledger.sqlite")
    t0 = time.monotonic()
    while _wait_row_in.get_run(_detached_id(p)) is None and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    assert _cli(["logs", "-f"], env, timeout=120).returncode == 0
    led = Ledger(r.parent / "home" / "ledger.sqlite")
    run = led.list_runs()[0]
    t0 = time.monotonic()
    while run.status == "running" and time.monotonic() - t0 < 30:
        time.sleep(0.5)
        run = led.get_run(run.id)
    assert run.status == "succeeded", run
    assert [e["action"] for e in led.events(run.id)][-1] == "end"


def test_an_unknown_fault_gets_a_did_you_mean(tmp_path, capsys, broker_home):
    p = _recipe(tmp_path, "name: j\nscript: train.py\nnodes: 2\ncpu_ok: true\n")
    code, out, err = _main(["run", str(p), "--provider", "netns", "--inject", "firewal"], capsys)
    assert code == 2 and "unknown fault 'firewal'" in err and "did you mean --inject firewall?" in err, err


def test_stop_of_an_unknown_run_says_so(capsys, broker_home):
    code, out, err = _main(["stop", "r-1"], capsys)
    assert code == 2 and "no run 'r-1'" in err and "broker status" in err, err


def test_ssh_config_install_edits_the_target_of_a_symlinked_config(tmp_path, monkeypatch):
    """``~/.ssh/config`` kept in a dotfiles folder (a symlink): the Include goes into the file it points to, the
    link stays a link."""
    from types import SimpleNamespace as NS

    from broker.cli.day2 import install_ssh_config, ssh_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BROKER_HOME", str(tmp_path / "broker-home"))
    dot = tmp_path / "home" / "dotfiles" / "ssh_config"
    dot.parent.mkdir(parents=True)
    dot.write_text("Host work\n  HostName 192.0.2.1\n")
    link = tmp_path / "home" / ".ssh" / "config"
    link.parent.mkdir()
    link.symlink_to(dot)
    node = NS(node_rank=0, host="198.18.0.9", user="root", port=22, local=False, resource_id="r-1")
    cluster = NS(nodes=[node], ssh_key_path=None, known_hosts_path=None)
    own, where, _ = install_ssh_config("r-1", ssh_config("r-1", cluster))
    assert link.is_symlink() and os.readlink(link) == str(dot)
    assert where == dot and f"Include {own}" in dot.read_text() and "Host work" in dot.read_text()
    assert "HostKeyAlias broker-res-r-1" in own.read_text()


def test_down_and_clean_remove_the_runs_ssh_host_entries(tmp_path, cli_env, broker_home):
    """`broker down` (nothing left live) and `broker clean` drop the run's Host block from broker's ssh config;
    other runs' blocks stay."""
    from datetime import timedelta
    from types import SimpleNamespace as NS

    from broker.cli.day2 import clean_candidates, install_ssh_config, remove_run_folders, ssh_config
    from broker.core.config import runs_dir
    from broker.core.model import utcnow
    from broker.core.private import private_dir
    from broker.core.records import Run
    from broker.money.ledger import Ledger

    led = Ledger()
    now = utcnow()
    ids = ["20261206-000000-aaaaaa", "20261206-000000-bbbbbb", "20261206-000000-cccccc"]
    user = tmp_path / "dot-ssh" / "config"
    for rid in ids:
        led.create_run(Run(id=rid, name="t", provider="fake", topology="simulated", status="succeeded",
                           created_at=now - timedelta(hours=1), ended_at=now, deadline=now,
                           run_dir=str(private_dir(runs_dir() / rid))))
        node = NS(node_rank=0, host="198.18.0.9", user="root", port=22, local=False, resource_id=None)
        install_ssh_config(rid, ssh_config(rid, NS(nodes=[node], ssh_key_path=None, known_hosts_path=None)),
                           user_config=user)
    own = broker_home / "ssh_config"
    p = _cli(["down", ids[0], "--yes"], cli_env)
    assert p.returncode == 0, p.stderr
    assert f"broker-{ids[0]}-n0" not in own.read_text() and f"broker-{ids[1]}-n0" in own.read_text()
    todo, _ = clean_candidates(led)
    remove_run_folders(led, [t for t in todo if t[0].id == ids[1]])
    text = own.read_text()
    assert f"broker-{ids[1]}-n0" not in text and f"Host broker-{ids[2]}-n0" in text
