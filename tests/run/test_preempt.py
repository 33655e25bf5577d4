"""Preemption of an interruptible run at the real boundaries: the file-backed fake cloud (its instance terminated
by the "provider" mid-run), netns hosts over SSH (a host's namespace removed mid-run), the checkpoint copy-back
(incremental, atomic, confined) and the ledger's attempt rows (migration from schema 1)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from broker.money.ledger import Ledger

# a training stand-in: resumes from ckpt/state.json when present, saves after every step (tmp + rename)
JOB = """
import json, os, pathlib, sys, time
ck = pathlib.Path("ckpt"); ck.mkdir(exist_ok=True)
state = ck / "state.json"
start = json.loads(state.read_text())["step"] if state.exists() else 0
print("resumed from step", start, flush=True)
pathlib.Path({marker!r} + ".pid").write_text(str(os.getpid()))
for step in range(start, {steps}):
    time.sleep({sleep})
    tmp = ck / "state.json.tmp"
    tmp.write_text(json.dumps({{"step": step + 1}}))
    os.replace(tmp, state)
    (ck / "blob.bin").write_bytes(b"x" * 1000) if step == 0 else None
    pathlib.Path({marker!r}).write_text(str(step + 1))
print("finished at step", {steps}, "started at", start, flush=True)
"""


def _recipe(tmp_path: Path, *, steps: int = 25, sleep: float = 0.25, extra: str = "", interruptible: str = "true"):
    from broker.core.recipe import load_recipe

    d = tmp_path / "r"
    d.mkdir(exist_ok=True)
    marker = tmp_path / "step"
    (d / "job.py").write_text(JOB.format(steps=steps, sleep=sleep, marker=str(marker)))
    (d / "r.yaml").write_text("name: t\nscript: job.py\nnodes: 1\ncpu_ok: true\ntopology: simulated\n"
                              f"budget_usd: 50\nmax_hours: 1\ninterruptible: {interruptible}\n"
                              "checkpoint_dir: ckpt\ncheckpoint_every_s: 1\n" + extra)
    return load_recipe(d / "r.yaml"), marker


def _step(marker: Path) -> int:
    try:
        return int(marker.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _preempt_fake(p, marker: Path, at_steps: list[int], done: list) -> threading.Thread:
    """The provider takes the running instance back when the job's step counter reaches each of ``at_steps``."""
    def go() -> None:
        for at in at_steps:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                live = [i for i, x in p.instances().items() if x["state"] == "running"]
                if live and _step(marker) >= at and live[0] not in done:
                    p.destroy(live[0])
                    done.append(live[0])
                    marker.write_text("0")
                    break
                time.sleep(0.05)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _fake_run(tmp_path, fake_cloud, at_steps, **kw):
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, marker = _recipe(tmp_path, **kw)
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    done: list = []
    t = _preempt_fake(p, marker, at_steps, done)
    said: list[str] = []
    err = None
    try:
        out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                           ledger=ledger, hooks=Hooks(say=said.append))
    except Exception as e:  # noqa: BLE001
        out, err = None, e
    t.join(timeout=5)
    return out, err, ledger, p, said, done


def test_a_preempted_interruptible_run_resumes_from_its_checkpoint_and_succeeds(tmp_path, fake_cloud):
    out, err, ledger, p, said, done = _fake_run(tmp_path, fake_cloud, [8])
    assert err is None, (err, said)
    assert len(done) == 1
    assert out.exit_code == 0, (out.result.reason, said)
    run = out.run
    log = Path(run.run_dir, "node0.log").read_text()
    resumed = int(log.split("resumed from step ")[1].split()[0])
    assert resumed > 0, log  # the second attempt started from the copied checkpoint, not from 0
    assert "finished at step 25" in log
    first = Path(run.run_dir, "attempt1", "node0.log").read_text()
    assert "resumed from step 0" in first  # the preempted attempt's own log is kept
    rows = ledger.attempts(run.id)
    assert [a["cause"] for a in rows] == ["preempted", "succeeded"]
    assert all(a["ended_at"] is not None for a in rows)
    assert len(rows[0]["resource_ids"]) == 1 and len(rows[1]["resource_ids"]) == 1
    assert rows[0]["resource_ids"] != rows[1]["resource_ids"]
    # nothing left: at the provider and in the ledger
    assert [i for i, x in p.instances().items() if x["state"] != "terminated"] == []
    assert ledger.resources(run.id, live_only=True) == []
    from broker.run.attempts import attempt_costs, attempt_lines

    costs = attempt_costs(ledger, run.id)
    assert all(a["usd"] > 0 for a in costs)
    assert sum(a["usd"] for a in costs) == pytest.approx(out.cost_usd, rel=0.05)
    lines = attempt_lines(ledger, run.id)
    assert lines[0].startswith("attempt 1:") and "preempted" in lines[0]
    assert "preemptions: 1" in lines[-1]
    assert any("renting again: attempt 2" in s for s in said)
    assert any("restored checkpoint gen-" in s for s in said)
    # broker status RUN and broker cost show the attempts, the preemption and each attempt's cost
    from typer.testing import CliRunner

    from broker.cli.app import app

    r = CliRunner().invoke(app, ["status", run.id, "--no-refresh"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "attempt 1:" in r.output and "preempted" in r.output and "attempt 2:" in r.output
    assert "preemptions: 1" in r.output
    r = CliRunner().invoke(app, ["status", run.id, "--no-refresh", "--json"])
    js = json.loads(r.output)
    assert [a["cause"] for a in js["attempts"]] == ["preempted", "succeeded"]
    r = CliRunner().invoke(app, ["cost", "--json"])
    (row,) = json.loads(r.output)["runs"]
    assert [a["attempt"] for a in row["attempts"]] == [1, 2]
    assert sum(a["usd"] for a in row["attempts"]) == pytest.approx(row["usd"], rel=0.05)
    r = CliRunner().invoke(app, ["cost"], env={"COLUMNS": "200"})
    assert "attempt 1" in r.output and "attempt 2" in r.output
    from broker.cli.summary import render_summary
    from broker.core.ui import console

    with console.capture() as cap:  # the end-of-run summary of `broker run`
        render_summary(out.run, out.result, None, out.cost_usd)
    summary = " ".join(cap.get().split())
    assert "attempts: 2 (1 preempted): #1 preempted" in summary
    # the wall time covers every attempt, as the cost does; the parts add up to the total as printed
    assert "over 2 attempts (the last" in summary, summary
    total = summary.split("cost: ")[1].split()[0]
    parts = [summary.split(f"#{n} {c} ")[1].split()[0].rstrip(",;") for n, c in ((1, "preempted"), (2, "succeeded"))]
    assert sum(float(x.strip("$")) for x in parts) == pytest.approx(float(total.strip("$")), abs=0.0001), summary
    assert f"broker logs {run.id} --attempt N" in summary
    # broker logs: the last attempt's log, a line on stderr naming the earlier one, and --attempt 1 prints it
    runner = CliRunner(mix_stderr=False) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else CliRunner()
    r = runner.invoke(app, ["logs", run.id])
    assert r.exit_code == 0 and "finished at step 25" in r.stdout and "attempt(s) 1 ended earlier" not in r.stdout
    assert f"broker logs {run.id} --node 0 --attempt 1" in r.stderr
    r = runner.invoke(app, ["logs", run.id, "--attempt", "1"])
    assert r.exit_code == 0 and "resumed from step 0" in r.stdout and "finished at step 25" not in r.stdout
    assert runner.invoke(app, ["logs", run.id, "--attempt", "2"]).stdout == Path(run.run_dir, "node0.log").read_text()
    r = runner.invoke(app, ["logs", run.id, "--attempt", "3"])
    # (the CLI's error boundary, broker.cli.app.main, prints it and exits 2; the runner sees the BadInput itself)
    assert "no log of attempt 3" in str(r.exception) and r.exception.hint == "--attempt 1..2", r.exception
    r = CliRunner().invoke(app, ["cost"], env={"COLUMNS": "200"})
    rows = {ln.split("│")[1].strip(): ln.split("│")[-2].strip() for ln in r.output.splitlines() if ln.count("│") >= 4}
    assert sum(float(rows[f"attempt {n}"].strip("$")) for n in (1, 2)) == pytest.approx(
        float(rows[run.id].strip("$")), abs=0.0001), r.output


def test_preempted_twice_in_a_row_still_resumes(tmp_path, fake_cloud):
    out, err, ledger, p, said, done = _fake_run(tmp_path, fake_cloud, [6, 4], steps=30)
    assert err is None, (err, said)
    assert len(done) == 2
    assert out.exit_code == 0, (out.result.reason, said)
    assert [a["cause"] for a in ledger.attempts(out.run.id)] == ["preempted", "preempted", "succeeded"]
    assert [i for i, x in p.instances().items() if x["state"] != "terminated"] == []


def test_max_restarts_stops_with_a_clear_message_and_leaves_nothing(tmp_path, fake_cloud):
    from broker.run.attempts import RestartsExhausted

    out, err, ledger, p, said, done = _fake_run(tmp_path, fake_cloud, [3, 3], steps=60, extra="max_restarts: 1\n")
    assert isinstance(err, RestartsExhausted), (err, said)
    assert "max_restarts: 1" in err.message and "preempted 2 time(s)" in err.message
    (run,) = ledger.list_runs()
    assert run.status == "failed" and "max_restarts" in run.message
    assert [a["cause"] for a in ledger.attempts(run.id)] == ["preempted", "preempted"]
    assert ledger.resources(run.id, live_only=True) == []
    assert [i for i, x in p.instances().items() if x["state"] != "terminated"] == []


def test_a_crash_is_not_restarted(tmp_path, fake_cloud):
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, marker = _recipe(tmp_path)
    (Path(recipe.workdir) / "job.py").write_text("raise RuntimeError('boom')\n")
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks())
    assert out.exit_code == 1
    assert [a["cause"] for a in ledger.attempts(out.run.id)] == ["failed"]
    assert len([r for r in ledger.resources(out.run.id) if r.kind == "instance"]) == 1


def test_not_interruptible_a_lost_node_fails_the_run_as_before(tmp_path, fake_cloud):
    from broker.run.guard import NodeLost

    out, err, ledger, p, said, done = _fake_run(tmp_path, fake_cloud, [3], interruptible="false")
    assert isinstance(err, NodeLost)
    (run,) = ledger.list_runs()
    assert ledger.attempts(run.id) == []
    assert ledger.resources(run.id, live_only=True) == []


# --------------------------------------------------------------------------------------------------- copy-back
class FlakySource:
    """A local checkpoint folder whose fetch fails after ``ok`` files (the node preempted mid-copy)."""

    def __init__(self, folder: Path, ok: int):
        from broker.run.checkpoint import LocalSource

        self.inner, self.ok, self.n = LocalSource(folder), ok, 0

    def list(self):
        return self.inner.list()

    def fetch(self, rel, dst, budget):
        self.n += 1
        if self.n > self.ok:
            raise ConnectionResetError("connection lost (preempted)")
        return self.inner.fetch(rel, dst, budget)


def test_copy_back_is_incremental_atomic_and_keeps_the_last_good_generation(tmp_path):
    from broker.run.checkpoint import CopyFailed, LocalSource, copy_back, latest_generation

    node = tmp_path / "node" / "ckpt"
    (node / "sub").mkdir(parents=True)
    (node / "a.pt").write_bytes(b"a" * 100)
    (node / "sub" / "b.pt").write_bytes(b"b" * 200)
    (node / "c.pt.tmp").write_bytes(b"half")  # in-progress name: never copied
    run = tmp_path / "run"
    gen1, got = copy_back(LocalSource(node), run)
    assert gen1.name == "gen-000001" and got == 300
    assert sorted(p.relative_to(gen1).as_posix() for p in gen1.rglob("*") if p.is_file()) == ["a.pt", "sub/b.pt"]
    assert copy_back(LocalSource(node), run) == (gen1, 0)  # nothing changed: no new generation
    time.sleep(0.01)
    (node / "a.pt").write_bytes(b"A" * 150)
    gen2, got = copy_back(LocalSource(node), run)
    assert gen2.name == "gen-000002" and got == 150  # only the changed file crossed
    assert os.stat(gen2 / "sub" / "b.pt").st_ino == os.stat(gen1 / "sub" / "b.pt").st_ino  # hard link
    # preempted mid-copy: the half-built generation never replaces the good one
    time.sleep(0.01)
    (node / "a.pt").write_bytes(b"Z" * 10)
    (node / "sub" / "b.pt").write_bytes(b"Y" * 10)
    with pytest.raises(CopyFailed, match="connection lost"):
        copy_back(FlakySource(node, ok=1), run)
    assert latest_generation(run) == gen2
    assert (gen2 / "a.pt").read_bytes() == b"A" * 150
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_copy_back_refuses_links_out_and_bad_names(tmp_path):
    from broker.run.checkpoint import LocalSource, Source, copy_back, latest_generation

    secret = tmp_path / "secret"
    secret.write_text("s")
    node = tmp_path / "ckpt"
    node.mkdir()
    (node / "ok.pt").write_text("1")
    (node / "leak.pt").symlink_to(secret)
    refused: list[str] = []
    gen, _ = copy_back(LocalSource(node), tmp_path / "run", refused=refused)  # the link is skipped, the rest copied
    assert sorted(p.name for p in gen.iterdir()) == ["ok.pt"]
    assert len(refused) == 1 and refused[0].startswith("'leak.pt' (") and "outside the checkpoint folder" in refused[0]

    class Evil(Source):
        def list(self):
            return {"../../escape": (1, 1)}

        def fetch(self, rel, dst, budget):  # pragma: no cover - must never be reached
            raise AssertionError(dst)

    refused = []
    assert copy_back(Evil(), tmp_path / "run2", refused=refused) == (None, 0)  # nothing taken: no generation
    assert ".." in refused[0] and latest_generation(tmp_path / "run2") is None
    assert not (tmp_path / "escape").exists()


def test_copy_back_respects_the_size_cap(tmp_path, monkeypatch):
    from broker.run.checkpoint import CopyFailed, LocalSource, copy_back, latest_generation
    from broker.run.artifacts import ArtifactBudget

    node = tmp_path / "ckpt"
    node.mkdir()
    (node / "big.pt").write_bytes(b"x" * 5000)
    with pytest.raises(CopyFailed, match="cap"):
        copy_back(LocalSource(node), tmp_path / "run", budget=ArtifactBudget(per_file=1000, total=10_000))
    assert latest_generation(tmp_path / "run") is None


# --------------------------------------------------------------------------------------------------- ledger
def test_a_schema_1_ledger_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "ledger.sqlite"
    from tests.support.ledgers import schema_1_ledger

    db = schema_1_ledger(path)
    db.execute("INSERT INTO events (at, run_id, actor, action) VALUES ('2026-01-01T00:00:00+00:00', 'x', 'cli', 'a')")
    db.commit()
    db.close()
    led = Ledger(path)
    assert led.schema_version == 2
    assert [e["action"] for e in led.events("x")] == ["a"]
    n = led.start_attempt("x")
    assert n == 1 and led.start_attempt("x") == 2
    led.end_attempt("x", 1, cause="preempted", detail="outbid")
    led.end_attempt("x", 1, cause="succeeded")  # the first end stays
    rows = led.attempts("x")
    assert rows[0]["cause"] == "preempted" and rows[0]["detail"] == "outbid" and rows[1]["ended_at"] is None


# --------------------------------------------------------------------------------------------------- netns (SSH)
from tests.support.netns_faults import kill_host as _kill_host  # noqa: E402


@pytest.mark.netns
def test_netns_host_lost_mid_run_is_rented_again_and_resumes(tmp_path):
    from tests.conftest import netns_missing

    why = netns_missing()
    if why:
        pytest.skip(why)
    from broker.providers import netns
    from broker.run.pipeline import Hooks, run_pipeline
    from broker.providers.netns.target import NetnsTarget

    recipe, marker = _recipe(tmp_path, steps=30, sleep=0.3)
    recipe = recipe.model_copy(update={"nodes": 2})
    target = NetnsTarget(recipe)
    ledger = Ledger()
    cids: list[str] = []

    def lose_node1() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            c = target.cluster_state
            if c is not None and _step(marker) >= 8:
                cids.append(c.cid)
                _kill_host(c.ns(1))
                marker.write_text("0")
                return
            time.sleep(0.05)

    t = threading.Thread(target=lose_node1, daemon=True)
    t.start()
    said: list[str] = []
    try:
        out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks(say=said.append))
    finally:
        t.join(timeout=5)
        for c in cids:
            netns.remove_cid(c)
        if target.cluster_state is not None:
            target.cluster_state.down()
    assert cids, said
    assert out.exit_code == 0, (out.result.reason, said)
    log = Path(out.run.run_dir, "node0.log").read_text()
    assert int(log.split("resumed from step ")[1].split()[0]) > 0, log
    assert [a["cause"] for a in ledger.attempts(out.run.id)] == ["preempted", "succeeded"]
    assert "ssh connection to node 1 lost" in ledger.attempts(out.run.id)[0]["detail"]
    assert ledger.resources(out.run.id, live_only=True) == []
    assert netns.leftovers(cids[0]) == [] and netns.leftovers(target.cluster_state.cid) == []


def test_the_shipped_ddp_train_resumes_from_its_checkpoint_after_a_preemption(tmp_path, fake_cloud):
    """recipes/ddp_train.py with --resume-dir: preempted once a checkpoint generation was copied back, the second
    attempt starts at a later epoch and the run passes its accuracy and DDP checks."""
    import shutil

    from broker.core.recipe import load_recipe
    from broker.providers.fake import FakeProvider
    from broker.run.checkpoint import latest_generation
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    from tests.conftest import REPO as repo
    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    d = tmp_path / "r"
    shutil.copytree(repo / "recipes", d, ignore=shutil.ignore_patterns("__pycache__", "*.yaml"))
    (d / "r.yaml").write_text(
        "name: t\nscript: ddp_train.py\nargs: [--epochs, '60', --min-accuracy, '0.85', --resume-dir, ck]\n"
        "nodes: 1\ncpu_ok: true\ntopology: simulated\nbudget_usd: 50\nmax_hours: 1\ninterruptible: true\n"
        "checkpoint_dir: ck\ncheckpoint_every_s: 1\nenv: {PYTHONWARNINGS: ignore}\n"
        "expect: ['DDP_OK']\n")
    recipe = load_recipe(d / "r.yaml")
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    done: list = []

    def preempt() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not done:
            runs = ledger.list_runs()
            live = [i for i, x in p.instances().items() if x["state"] == "running"]
            if runs and live and latest_generation(Path(runs[0].run_dir)) is not None:
                p.destroy(live[0])
                done.append(live[0])
            time.sleep(0.05)

    t = threading.Thread(target=preempt, daemon=True)
    t.start()
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks())
    t.join(timeout=5)
    assert done, "the job ended before a checkpoint was copied back"
    log = Path(out.run.run_dir, "node0.log").read_text()
    assert out.exit_code == 0, (out.result.reason, log[-2000:])
    assert int(log.split("resumed_from_epoch=")[1].split()[0]) > 0, log
    first = Path(out.run.run_dir, "attempt1", "node0.log").read_text()  # a fresh start does not say "resumed"
    assert "start_epoch=0 (no checkpoint to resume from yet)" in first and "resumed_from_epoch" not in first
    assert [a["cause"] for a in ledger.attempts(out.run.id)] == ["preempted", "succeeded"]
    assert ledger.resources(out.run.id, live_only=True) == []


def test_preemption_during_teardown_is_confirmed_and_not_restarted(tmp_path, fake_cloud):
    """The provider takes each instance back while broker is terminating it, and the terminate call answers HTTP
    500 once: teardown retries until the provider shows it gone (between the attempts and at the end), the run
    still resumes and succeeds, and nothing is left."""
    from broker.core.provider import TransientError
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    class TakenBackDuringTeardown(FakeProvider):
        seen: set = set()

        def terminate(self, kind, provider_id, **kw):
            if kind == "instance" and provider_id not in self.seen:
                self.seen.add(provider_id)
                self.destroy(provider_id)  # the provider reclaims it first ...
                raise TransientError(self.name, "terminate", "HTTP 500 (fake)")  # ... and our call fails
            return super().terminate(kind, provider_id, **kw)

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, marker = _recipe(tmp_path)
    p = TakenBackDuringTeardown()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    done: list = []
    t = _preempt_fake(p, marker, [8], done)
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks())
    t.join(timeout=5)
    assert out.exit_code == 0 and done
    assert len(p.seen) == 2  # both instances were reclaimed during their teardown
    assert [a["cause"] for a in ledger.attempts(out.run.id)] == ["preempted", "succeeded"]
    assert ledger.resources(out.run.id, live_only=True) == []
    assert [i for i, x in p.instances().items() if x["state"] != "terminated"] == []


SSH_JOB = """
import json, os, pathlib, time
ck = pathlib.Path("ckpt"); ck.mkdir(exist_ok=True)
state = ck / "state.json"
start = json.loads(state.read_text())["step"] if state.exists() else 0
print("resumed from step", start, flush=True)
for step in range(start, 30):
    time.sleep(0.3)
    for name in ("a.bin", "b.bin", "c.bin"):  # three files change every step: a copy fetches all three
        tmp = ck / (name + ".tmp"); tmp.write_bytes(os.urandom(200_000)); os.replace(tmp, ck / name)
    tmp = ck / "state.json.tmp"; tmp.write_text(json.dumps({"step": step + 1})); os.replace(tmp, state)
    pathlib.Path(%r).write_text(str(step + 1))
print("finished at step 30 started at", start, flush=True)
"""


@pytest.mark.netns
def test_netns_node0_lost_during_the_checkpoint_copy_keeps_the_last_good_generation(tmp_path, monkeypatch):
    """Node 0's host dies after the first file of a copy arrived: that generation never replaces the good one, and
    the next attempt resumes from the good one."""
    from tests.conftest import netns_missing

    why = netns_missing()
    if why:
        pytest.skip(why)
    from broker.providers import netns
    from broker.run import checkpoint
    from broker.run.pipeline import Hooks, run_pipeline
    from broker.providers.netns.target import NetnsTarget

    recipe, marker = _recipe(tmp_path)
    (Path(recipe.workdir) / "job.py").write_text(SSH_JOB % str(marker))
    target = NetnsTarget(recipe)
    ledger = Ledger()
    killed: dict = {}
    orig = checkpoint.SSHSource.fetch

    arrived: dict[Path, int] = {}  # files fetched per generation being copied

    def fetch(self, rel, dst, budget):
        gen_dir = dst.parents[len(Path(rel).parts) - 1]  # <run>/checkpoints/.tmp-gen-N/<rel>
        good = checkpoint.latest_generation(gen_dir.parent.parent)
        # the host dies between two files of one copy: one file of it has arrived and this one never will (a
        # copy whose only changed file was its last would complete before a kill that followed it)
        if not killed and good is not None and arrived.get(gen_dir, 0) >= 1 and _step(marker) >= 6:
            killed["good"] = good.name
            killed["step"] = json.loads((good / "state.json").read_text())["step"]
            killed["cid"] = target.cluster_state.cid
            killed["pids"] = _kill_host(target.cluster_state.ns(0))
            n = orig(self, rel, dst, budget)  # must raise: nothing of that host answers now
            killed["fetched after the kill"] = rel
            return n
        n = orig(self, rel, dst, budget)
        arrived[gen_dir] = arrived.get(gen_dir, 0) + 1
        return n

    monkeypatch.setattr(checkpoint.SSHSource, "fetch", fetch)
    try:
        out = run_pipeline(recipe, target, ledger=ledger, hooks=Hooks())
    finally:
        if killed.get("cid"):
            netns.remove_cid(killed["cid"])
        if target.cluster_state is not None:
            target.cluster_state.down()
    assert killed, "no copy ran after the first generation"
    assert "fetched after the kill" not in killed, killed
    assert out.exit_code == 0, out.result.reason
    log = Path(out.run.run_dir, "node0.log").read_text()
    gens = {g.name: json.loads((g / "state.json").read_text())["step"]
            for g in sorted((Path(out.run.run_dir) / "checkpoints").glob("gen-*")) if (g / "state.json").is_file()}
    assert f"resumed from step {killed['step']}\n" in log, (killed, gens, log[:500])
    assert [a["cause"] for a in ledger.attempts(out.run.id)] == ["preempted", "succeeded"]
    assert ledger.resources(out.run.id, live_only=True) == []


def test_the_providers_word_makes_a_killed_job_a_preemption(tmp_path, fake_cloud):
    """Outbid on Vast: the provider stops the container, the job's processes are killed (the rank dies with
    SIGKILL, torchrun exits 1: it looks like a crash), and the provider's preemption() says why: a preemption,
    rented again, resumed."""
    import signal

    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    class Outbid(FakeProvider):
        taken: set = set()

        def preemption(self, resource_id):
            return "outbid: actual_status stopped, intended running" if resource_id in self.taken else None

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, marker = _recipe(tmp_path)
    p = Outbid()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()

    def outbid() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            live = [i for i, x in p.instances().items() if x["state"] == "running"]
            if live and _step(marker) >= 8:
                p.taken.add(live[0])
                marker.write_text("0")
                os.kill(int(Path(str(marker) + ".pid").read_text()), signal.SIGKILL)
                return
            time.sleep(0.05)

    t = threading.Thread(target=outbid, daemon=True)
    t.start()
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks())
    t.join(timeout=5)
    assert p.taken
    assert out.exit_code == 0, out.result.reason
    rows = ledger.attempts(out.run.id)
    assert [a["cause"] for a in rows] == ["preempted", "succeeded"]
    assert "outbid" in rows[0]["detail"]
    assert ledger.resources(out.run.id, live_only=True) == []


@pytest.mark.parametrize("rule", ["3", "checkpoint+2"])
def test_the_fake_cloud_takes_an_instance_back_when_told_and_the_run_resumes(tmp_path, fake_cloud, monkeypatch,
                                                                             rule):
    """BROKER_FAKE_PREEMPT: the pretend cloud reclaims the first instance 3 s after it runs (or once the run's
    first checkpoint copy landed: a demo on a slow machine resumes all the same), as a spot market would; the node
    check sees it gone, the provider's word makes it a preemption, the run rents again (the second instance is left
    alone) and resumes from the copied checkpoint."""
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    monkeypatch.setenv("BROKER_FAKE_PREEMPT", rule)
    recipe, marker = _recipe(tmp_path, steps=40)
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    said: list[str] = []
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks(say=said.append))
    assert out.exit_code == 0, out.result.reason
    rows = ledger.attempts(out.run.id)
    assert [a["cause"] for a in rows] == ["preempted", "succeeded"], rows
    assert "reclaimed" in rows[0]["detail"]
    insts = sorted(p.instances().values(), key=lambda i: i["ordinal"])
    assert [(i["state"], bool(i.get("reclaimed"))) for i in insts] == [("terminated", True), ("terminated", False)]
    log = Path(out.run.run_dir, "node0.log").read_text()
    resumed = [int(line.split()[-1]) for line in log.splitlines() if line.startswith("resumed from step")]
    # restored from the last copy, whatever step it held (this script saves one at step 0; on a loaded machine the
    # node may be taken back before a later one was copied)
    assert resumed, log[-2000:]
    assert ledger.resources(out.run.id, live_only=True) == []


def test_the_node_check_interval_is_the_providers_own(tmp_path, fake_cloud):
    """A run's nodes are described every ``node_check_s`` of the providers it may rent from: the fake cloud's state
    file every 2 s, a cloud's API every 30 s; an explicit ``monitor_s`` wins."""
    from dataclasses import replace

    from broker.providers.fake import FakeProvider
    from broker.run.cloudtarget import CloudTarget
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, _ = _recipe(tmp_path)
    opts = [o for o in rank_options(FakeProvider(), recipe.requirements()) if o.topology.value == "simulated"]
    assert CloudTarget(recipe, opts).monitor_s == 2.0
    assert CloudTarget(recipe, [replace(o, provider="aws") for o in opts]).monitor_s == 30.0
    assert CloudTarget(recipe, opts, monitor_s=0.5).monitor_s == 0.5


def test_a_malformed_fake_preempt_rule_names_the_variable(tmp_path, monkeypatch):
    from broker.core.provider import BadInput
    from broker.providers.fake import _preempt_rule

    monkeypatch.setenv("BROKER_FAKE_PREEMPT", "soon")
    with pytest.raises(BadInput, match="BROKER_FAKE_PREEMPT='soon' is not <seconds>"):
        _preempt_rule()
    for bad in ("nan", "inf", "-5", "60:x", "60:-1", ":3"):
        monkeypatch.setenv("BROKER_FAKE_PREEMPT", bad)
        with pytest.raises(BadInput, match="is not <seconds>"):
            _preempt_rule()
    monkeypatch.setenv("BROKER_FAKE_PREEMPT", "60:2")
    assert _preempt_rule() == (60.0, 2, False)
    for after_copy, want in (("checkpoint", (0.0, 1, True)), ("checkpoint+5:2", (5.0, 2, True))):
        monkeypatch.setenv("BROKER_FAKE_PREEMPT", after_copy)
        assert _preempt_rule() == want
    for bad in ("checkpoint+x", "checkpoint-5", "checkpointy"):
        monkeypatch.setenv("BROKER_FAKE_PREEMPT", bad)
        with pytest.raises(BadInput, match="checkpoint\\[\\+<seconds>\\]"):
            _preempt_rule()
    monkeypatch.setenv("BROKER_FAKE_PREEMPT", "")
    assert _preempt_rule() is None


def test_a_malformed_fake_preempt_rule_is_bad_input_before_anything_is_rented(cli_env, tmp_path):
    """BROKER_FAKE_PREEMPT=abc was read at the first describe: every failover option rented and released pretend
    instances (10, and a network) and the run ended as a provider error (exit 4).  A setting is checked with the
    provider, before the plan rents: exit 2, the variable and an example, nothing created."""
    import subprocess

    from tests.conftest import REPO, broker_cmd

    state = tmp_path / "fake.json"
    env = dict(cli_env, BROKER_FAKE_STATE=str(state), BROKER_FAKE_PREEMPT="abc")
    p = subprocess.run(broker_cmd("run", "recipes/ddp_preempt_demo.yaml", "--provider", "fake", "-y"), cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.stdout[-2000:], p.stderr[-2000:])
    assert "error: BROKER_FAKE_PREEMPT='abc' is not <seconds>[:<n>]" in p.stderr and "BROKER_FAKE_PREEMPT=60" in p.stderr
    assert "Traceback" not in p.stderr
    held = json.loads(state.read_text()) if state.exists() else {}
    assert not held.get("instances") and not held.get("networks"), held


def test_the_checkpoint_wrapper_announces_only_the_steps_the_executor_has(tmp_path):
    from broker.run.checkpoint import CheckpointingExecutor, NodeFoldersSource, with_checkpoints
    from broker.run.executor import Executor

    class Local(Executor):  # like LocalExecutor: no reach, no preflight
        dirs = [tmp_path]

        def stage(self):
            return None

        def launch(self):
            raise AssertionError

        def finish(self, result):
            return result

        def checkpoint_source(self, rel_dir):
            return NodeFoldersSource(lambda: self.dirs, rel_dir)

    class Remote(Local):
        def reach(self):
            return "reached"

    class R:
        checkpoint_dir, checkpoint_every_s = "ck", 5

    w = with_checkpoints(Local(), R(), tmp_path)
    assert isinstance(w, CheckpointingExecutor) and w.every_s == 5
    assert w.steps() == () and Local().steps() == ()
    w = with_checkpoints(Remote(), R(), tmp_path)
    assert w.steps() == ("reach",) and w.reach() == "reached"
    R.checkpoint_dir = None
    plain = Local()
    assert with_checkpoints(plain, R(), tmp_path) is plain


def test_no_new_attempt_when_the_runs_clock_is_nearly_out(tmp_path, fake_cloud):
    """Preempted 50 s before the hard deadline: nothing is rented again (the run's one clock), the run fails with
    that reason, the attempt is recorded and nothing is left."""
    from datetime import timedelta

    from broker.core.model import utcnow
    from broker.providers.fake import FakeProvider
    from broker.run.guard import NodeLost
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, marker = _recipe(tmp_path, steps=200)
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    done: list = []
    t = _preempt_fake(p, marker, [3], done)

    def on_start(run, _desc) -> None:
        ledger.update_run(run.id, deadline=utcnow() + timedelta(seconds=50))

    with pytest.raises(NodeLost, match="left on the run's deadline: not renting again"):
        run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                     ledger=ledger, hooks=Hooks(on_start=on_start))
    t.join(timeout=5)
    (run,) = ledger.list_runs()
    assert [a["cause"] for a in ledger.attempts(run.id)] == ["preempted"]
    assert len([r for r in ledger.resources(run.id) if r.kind == "instance"]) == 1
    assert ledger.resources(run.id, live_only=True) == []


def test_multi_node_preempted_node_1_the_whole_cluster_is_rented_again(tmp_path, fake_cloud):
    """Two instances in a private network (the fake bootstraps a vcn + subnet the way OCI does): node 1 is taken
    back; both instances and the network are released, a new network and two new instances are rented, the job
    resumes; nothing of either attempt is left."""
    from broker.core.recipe import load_recipe
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, marker = _recipe(tmp_path)
    y = Path(recipe.path).read_text().replace("nodes: 1", "nodes: 2").replace("simulated", "multi-node")
    Path(recipe.path).write_text(y)
    recipe = load_recipe(recipe.path)
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "multi-node"]
    ledger = Ledger()
    done: list = []

    def take_node1() -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            runs = ledger.list_runs()
            rows = [r for r in ledger.resources(runs[0].id, live_only=True)
                    if r.kind == "instance" and r.attrs.get("node_index") == 1] if runs else []
            if rows and rows[0].provider_id and _step(marker) >= 8:
                p.destroy(rows[0].provider_id)
                done.append(rows[0].provider_id)
                marker.write_text("0")
                return
            time.sleep(0.05)

    t = threading.Thread(target=take_node1, daemon=True)
    t.start()
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks())
    t.join(timeout=5)
    assert done and out.exit_code == 0, out.result and out.result.reason
    attempts = ledger.attempts(out.run.id)
    assert [a["cause"] for a in attempts] == ["preempted", "succeeded"]
    kinds = [sorted(ledger.resource(i).kind for i in a["resource_ids"]) for a in attempts]
    assert kinds[0] == kinds[1] and kinds[0].count("instance") == 2 and len(kinds[0]) > 2  # + vcn, subnet
    assert ledger.resources(out.run.id, live_only=True) == []
    assert [i for i, x in p.instances().items() if x["state"] != "terminated"] == []
    assert [n for n, x in p.networks().items() if x["state"] != "terminated"] == []


def test_no_capacity_for_the_next_attempt_fails_the_run_with_every_attempt_recorded(tmp_path, fake_cloud,
                                                                                    monkeypatch):
    from broker.core.provider import NoValidPlan
    from broker.providers.fake import ZONES

    def no_capacity_after(*_a) -> None:
        os.environ["BROKER_FAKE_FAIL"] = ",".join(f"capacity@{z}" for z in ZONES)

    monkeypatch.setenv("BROKER_FAKE_FAIL", "")
    from broker.providers import fake

    orig = fake.FakeProvider.destroy

    def destroy(self, pid):
        orig(self, pid)
        no_capacity_after()

    monkeypatch.setattr(fake.FakeProvider, "destroy", destroy)
    out, err, ledger, p, said, done = _fake_run(tmp_path, fake_cloud, [4])
    os.environ.pop("BROKER_FAKE_FAIL", None)
    assert isinstance(err, NoValidPlan), (err, said)
    (run,) = ledger.list_runs()
    rows = ledger.attempts(run.id)
    assert [a["cause"] for a in rows] == ["preempted", "error"]
    assert "capacity" in rows[1]["detail"]
    assert ledger.resources(run.id, live_only=True) == []


def test_broker_status_elsewhere_keeps_who_terminated_a_node(tmp_path, fake_cloud):
    """`broker down` in another terminal claims a node and terminates it; `broker status` in a third sees it gone
    before `down` confirms: the row keeps ``terminated_by 'down'`` (not "provider"), so the run's CLI still
    reads broker's own end, not a preemption; a node the provider ended unclaimed is "provider"'s."""
    from broker.cli.status import refresh_live
    from broker.providers.fake import FakeProvider
    from broker.run.attempts import broker_ended
    from broker.run.runrecord import Context, Hooks
    from tests.support.watchdog_helpers import make_run, provision

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    ledger, fake = Ledger(), FakeProvider()
    run = make_run(ledger, pid=os.getpid())
    a, b = provision(ledger, fake, run, nodes=2)
    ledger.start_attempt(run.id)
    ctx = Context(ledger=ledger, hooks=Hooks(), actor="cli")
    assert broker_ended(ctx, run) is None
    ledger.claim_termination(a.id, "down")
    fake.terminate("instance", a.provider_id)
    fake.destroy(b.provider_id)  # the provider ends the other one behind everyone's back
    refresh_live(ledger, {"fake": fake})
    rows = {r.id: r for r in ledger.resources(run.id)}
    assert (rows[a.id].state, rows[a.id].terminated_by) == ("terminated", "down")
    assert (rows[b.id].state, rows[b.id].terminated_by) == ("terminated", "provider")
    assert broker_ended(ctx, run) == f"fake instance {a.provider_id} was terminated by broker's down"


# --------------------------------------------------------------------------------------------------- finished
FINISHED_JOB = """
import pathlib, sys, time
print("DDP_OK", flush=True)
pathlib.Path({marker!r}).write_text("done")
time.sleep(40)  # torchrun's exit barrier, a slow interpreter exit: the ranks' work is done
"""


def test_a_preemption_after_the_ranks_finished_is_a_success_and_rents_nothing_again(tmp_path, fake_cloud,
                                                                                      monkeypatch):
    """The pretend cloud takes the instance back right after the job printed its ``expect`` line (DDP_OK), before
    it exited: the run is done (collect, tear down, record success), never rented again."""
    from broker.core.recipe import load_recipe
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    d = tmp_path / "r"
    d.mkdir()
    (d / "job.py").write_text(FINISHED_JOB.format(marker=str(tmp_path / "done")))
    (d / "r.yaml").write_text("name: t\nscript: job.py\nnodes: 1\ncpu_ok: true\ntopology: simulated\n"
                              "budget_usd: 50\nmax_hours: 1\ninterruptible: true\nexpect: [DDP_OK]\n")
    recipe = load_recipe(d / "r.yaml")
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    said: list[str] = []
    done: list = []

    def take_back() -> None:  # the provider reclaims the instance once the job's work is done
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not done:
            live = [i for i, x in p.instances().items() if x["state"] == "running"]
            if live and (tmp_path / "done").exists():
                p.destroy(live[0])
                done.append(live[0])
            time.sleep(0.05)

    th = threading.Thread(target=take_back, daemon=True)
    th.start()
    t0 = time.monotonic()
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks(say=said.append))
    th.join(timeout=5)
    assert done, said
    assert out.exit_code == 0 and out.result.status == "succeeded", (out.result.reason, said)
    assert "before a node was lost" in out.result.reason and "not rented again" in out.result.reason
    assert (tmp_path / "done").exists()
    rows = ledger.attempts(out.run.id)
    assert [a["cause"] for a in rows] == ["succeeded"], rows
    assert len(p.instances()) == 1  # one instance ever rented
    assert [i["state"] for i in p.instances().values()] == ["terminated"]
    assert ledger.resources(out.run.id, live_only=True) == []
    assert ledger.get_run(out.run.id).status == "succeeded"
    assert time.monotonic() - t0 < 40  # it did not wait for a second attempt's job


def test_ranks_finished_reads_exit_codes_and_the_expect_lines(tmp_path):
    from types import SimpleNamespace

    from broker.run.attempts import classify, ranks_finished
    from broker.run.supervisor import RunResult

    recipe = SimpleNamespace(nodes=2, expect=["DDP_OK"])
    run = SimpleNamespace(run_dir=str(tmp_path))
    # every node exited 0, then the provider said it took one back: done
    ok = RunResult(status="succeeded", exit_codes={0: 0, 1: 0}, wall_s=1.0, log_paths={})
    assert classify(ok, None, "reclaimed").preempted and ranks_finished(recipe, run, ok) == "every node had exited 0"
    # exit 0 without the expected output is not a finished job
    bare = RunResult(status="failed", exit_codes={0: 0, 1: 0}, wall_s=1.0, log_paths={}, missing_expect=["DDP_OK"])
    assert ranks_finished(recipe, run, bare) is None
    # a connection dropped (code unknown): done only when rank 0's log already holds every expected line
    cut = RunResult(status="failed", exit_codes={0: None, 1: None}, wall_s=1.0, log_paths={}, failed_node=0)
    assert classify(cut, None, None).preempted and ranks_finished(recipe, run, cut) is None
    (tmp_path / "node0.log").write_text("epoch 2 loss 0.1\nDDP_OK\n")
    assert "every expected line ('DDP_OK')" in ranks_finished(recipe, run, cut)
    assert ranks_finished(SimpleNamespace(nodes=2, expect=[]), run, cut) is None  # nothing to tell it by


def test_the_end_of_a_run_not_kept_removes_its_ssh_host_entries(tmp_path, fake_cloud):
    """A `Host` block installed while the run was live (`broker ssh RUN --config --install`) is gone once the
    pipeline has released the run's machines; another run's block stays."""
    from types import SimpleNamespace as NS

    from broker.cli.day2 import install_ssh_config, ssh_config
    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.support.plans import rank_options

    home = fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, _ = _recipe(tmp_path, steps=2, sleep=0.05, interruptible="false")
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    user = tmp_path / "dot-ssh" / "config"
    node = NS(node_rank=0, host="198.18.0.9", user="root", port=22, local=False, resource_id=None)
    cluster = NS(nodes=[node], ssh_key_path=None, known_hosts_path=None)
    install_ssh_config("other-run", ssh_config("other-run", cluster), user_config=user)
    installed: list[str] = []

    def say(_line: str) -> None:  # the user installs the run's entries while it runs
        runs = ledger.list_runs()
        if runs and not installed:
            installed.append(runs[0].id)
            install_ssh_config(runs[0].id, ssh_config(runs[0].id, cluster), user_config=user)

    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks(say=say))
    assert out.exit_code == 0 and installed == [out.run.id]
    text = (home / "ssh_config").read_text()
    assert f"broker-{out.run.id}-n0" not in text and "Host broker-other-run-n0" in text
