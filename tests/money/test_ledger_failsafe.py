"""Teardown never depends on the ledger: a ledger locked by another process (a real ``BEGIN EXCLUSIVE`` held by a
second process) or on a full filesystem (a real tmpfs filled up) still lets every delete go out; what could not be
recorded is journalled beside the ledger (or on another filesystem), named at exit with its $/hour and the command
that ends it, and replayed by the next broker command that can write the ledger."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from broker.core.model import utcnow
from broker.core.records import Run
from broker.money.journal import JOURNAL_NAME, Journal, fallback_path
from broker.money.ledger import Ledger
from tests.conftest import REPO, broker_cmd

needs_mount = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="needs root to mount a tmpfs")


@contextmanager
def locked(db: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``BEGIN EXCLUSIVE`` on ``db`` until the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys\n"
        f"db = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE')\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def _states(db: Path, run_id: str) -> list[str]:
    """The resource states as the file says (a plain read: WAL readers pass a writer's lock)."""
    con = sqlite3.connect(str(db))
    try:
        return [r[0] for r in con.execute("SELECT state FROM resources WHERE run_id = ?", (run_id,))]
    finally:
        con.close()


def _vast_run(ledger: Ledger, emu, run_id: str, *, deadline=None) -> tuple[str, int]:
    """A run with one labelled, running Vast instance in the emulator and the ledger; (resource id, instance id)."""
    from broker.providers.vast import make_label

    iid = emu.add_instance(make_label(run_id, 0, ledger.installation_id, "r-tok"))
    ledger.create_run(Run(id=run_id, name="job", provider="vast", status="running", created_at=utcnow(),
                          deadline=deadline))
    res = ledger.record_intent(run_id, "vast", "instance", f"broker-{run_id}-n0", usd_per_hour=0.41)
    ledger.mark_created(res.id, str(iid), state="running")
    return res.id, iid


@pytest.fixture
def vast_emu(monkeypatch):
    from tests.support.vast_emulator import API_KEY, VastEmulator

    emu = VastEmulator(None, hostless=True)
    monkeypatch.setenv("VAST_API_URL", emu.url)
    monkeypatch.setenv("VAST_API_KEY", API_KEY)
    try:
        yield emu
    finally:
        emu.close()


def _vast(emu):
    from broker.providers.vast import VastProvider
    from tests.support.vast_emulator import API_KEY

    return VastProvider(api_key=API_KEY, api_url=emu.url, sleep=lambda s: None, delete_timeout_s=10)


def test_broker_down_with_the_ledger_locked_deletes_journals_and_the_next_command_records_it(vast_emu, broker_home,
                                                                                             cli_env, capsys):
    """The exact case: `broker down` with the ledger locked by another process ended `database is locked`, exit 2,
    no DELETE.  Now the DELETE goes out, the instance is gone, the journal (0600) holds the writes, the terminal
    names the instance with its $/h, the exit code is 10 (0 + unrecorded), and `broker status` records it."""
    db = broker_home / "ledger.sqlite"
    lg = Ledger(db)
    rid, iid = _vast_run(lg, vast_emu, "20261206-000000-d0wn01")
    lg.close()
    env = dict(cli_env, VAST_API_URL=vast_emu.url)
    with locked(db):
        r = subprocess.run(broker_cmd("down", "20261206-000000-d0wn01", "--yes"), env=env, capture_output=True,
                           text=True, timeout=120, cwd=REPO)
        out = r.stdout + r.stderr
        assert r.returncode == 10, out
        assert vast_emu.deletes_of(iid) >= 1 and iid not in vast_emu.instances
        assert _states(db, "20261206-000000-d0wn01") == ["running"]  # the ledger could not take it
        journal = broker_home / JOURNAL_NAME
        assert stat.S_IMODE(journal.stat().st_mode) == 0o600
        entries = Journal.read(journal)
        assert [e["op"] for e in entries][:1] == ["claim_termination"]
        assert any(e["op"] == "update_resource" and e["kwargs"].get("state") == "terminated" for e in entries)
        assert "database is locked" in out and f"vast instance {iid} ($0.41/h) was deleted" in out
        assert str(journal) in out
        Ledger(db).close()  # another command opens the ledger while it is still locked: the journal waits, said once
        assert "ledger write(s) an earlier broker command could not make wait in" in capsys.readouterr().err
        assert _states(db, "20261206-000000-d0wn01") == ["running"] and journal.stat().st_size > 0
    r = subprocess.run(broker_cmd("status"), env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _states(db, "20261206-000000-d0wn01") == ["terminated"]
    assert journal.stat().st_size == 0
    lg = Ledger(db)
    (row,) = lg.resources("20261206-000000-d0wn01")
    assert row.terminated_by == "down" and row.terminated_at is not None
    assert (row.terminated_at - utcnow()).total_seconds() < 0
    assert any(e["action"] == "journal-replay" for e in lg.events())
    run = lg.get_run("20261206-000000-d0wn01")
    assert run.status == "interrupted"  # `down` settled the run (its CLI is gone), recorded from the journal


def test_the_watchdog_deletes_at_the_deadline_while_the_ledger_is_locked_and_records_it_later(vast_emu, broker_home):
    from datetime import timedelta

    from broker.money.watchdog import Watchdog

    db = broker_home / "ledger.sqlite"
    lg = Ledger(db)
    rid, iid = _vast_run(lg, vast_emu, "20261206-000000-wdog01", deadline=utcnow() - timedelta(minutes=1))
    p = _vast(vast_emu)
    wd = Watchdog(Ledger(db), providers={"vast": p}, confirm_timeout_s=10, interval_s=0.5)
    with locked(db):
        t0 = time.monotonic()
        actions = wd.run_once()
        assert time.monotonic() - t0 < 60
        assert vast_emu.deletes_of(iid) >= 1 and iid not in vast_emu.instances
        assert any(a.ok and a.provider_id == str(iid) for a in actions), actions
        assert _states(db, "20261206-000000-wdog01") == ["running"]
        assert wd.ledger.resource(rid).state == "terminated"  # what it kept, it reads
        assert (broker_home / JOURNAL_NAME).stat().st_size > 0
        assert not wd.ledger.resources(live_only=True)  # the next pass does not delete it again
    wd.run_once()  # the lock is gone: the kept writes reach the ledger
    assert _states(db, "20261206-000000-wdog01") == ["terminated"]
    assert lg.get_run("20261206-000000-wdog01").status == "deadline"
    assert vast_emu.deletes_of(iid) == 1


@contextmanager
def _small_fs(tmp_path: Path, mib: int = 6) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(folder: Path) -> Path:
    """Fill the filesystem of ``folder`` to the last byte (like a job's checkpoints)."""
    blob = folder / "filler.bin"
    fd = os.open(blob, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"x" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return blob


@needs_mount
def test_a_full_home_releases_the_space_reserve_to_record_the_teardown(vast_emu, tmp_path):
    from broker.money.teardown import teardown_run
    from broker.run.runrecord import _reserve_space

    with _small_fs(tmp_path) as home:
        lg = Ledger(home / "ledger.sqlite")
        rid, iid = _vast_run(lg, vast_emu, "20261206-000000-full01")
        _reserve_space(lg)
        assert (home / ".space-reserve").exists()
        _fill(home)
        with pytest.raises(sqlite3.OperationalError, match="full"):  # the disk is really full for the ledger
            lg.event("20261206-000000-full01", "test", "probe", "x" * 200000)
        said: list[str] = []
        left = teardown_run(lg, "20261206-000000-full01", "cli", providers={"vast": _vast(vast_emu)},
                            say=said.append, poll_s=0.1, confirm_timeout_s=10)
        assert left == []
        assert vast_emu.deletes_of(iid) >= 1 and iid not in vast_emu.instances
        assert not (home / ".space-reserve").exists()  # used for exactly this
        assert _states(home / "ledger.sqlite", "20261206-000000-full01") == ["terminated"]
        assert any("is full" in s and "space reserve" in s for s in said), said
        lg.close()


@needs_mount
def test_a_full_home_without_reserve_journals_on_another_filesystem_and_a_later_open_replays(vast_emu, tmp_path):
    from broker.money.journal import unrecorded_lines
    from broker.money.teardown import teardown_run

    with _small_fs(tmp_path) as home:
        if os.stat(home).st_dev == os.stat(fallback_path(home).parent.parent).st_dev:
            pytest.skip("/tmp is the same filesystem")
        lg = Ledger(home / "ledger.sqlite")
        rid, iid = _vast_run(lg, vast_emu, "20261206-000000-full02")
        blob = _fill(home)
        try:
            left = teardown_run(lg, "20261206-000000-full02", "cli", providers={"vast": _vast(vast_emu)},
                                poll_s=0.1, confirm_timeout_s=10)
            assert left == []  # as this process reads it
            assert vast_emu.deletes_of(iid) >= 1 and iid not in vast_emu.instances
            assert _states(home / "ledger.sqlite", "20261206-000000-full02") == ["running"]
            other = fallback_path(home)
            assert other.exists() and stat.S_IMODE(other.stat().st_mode) == 0o600
            assert any(e["kwargs"].get("state") == "terminated" for e in Journal.read(other))
            lines = unrecorded_lines()
            assert any(f"vast instance {iid} ($0.41/h) was deleted" in ln and str(other) in ln for ln in lines), lines
        finally:
            blob.unlink()  # space again
        lg.close()
        lg2 = Ledger(home / "ledger.sqlite")  # the next command opens the ledger: replayed
        assert [r.state for r in lg2.resources("20261206-000000-full02")] == ["terminated"]
        assert not other.exists() or other.stat().st_size == 0
        lg2.close()


def test_a_ledger_first_write_still_refuses_to_create(tmp_path):
    """record_intent (before a provider call) is never journalled: a locked ledger stops the create."""
    from broker.money.journal import failsafe

    db = tmp_path / "ledger.sqlite"
    lg = Ledger(db)
    lg.create_run(Run(id="r-intent", name="x", status="running", created_at=utcnow()))
    f = failsafe(lg)
    with locked(db):
        lg._db.execute("PRAGMA busy_timeout=200")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            f.record_intent("r-intent", "vast", "instance", "n0")
    assert not (tmp_path / JOURNAL_NAME).exists()


def test_exit_codes_say_both_things():
    from broker.money.journal import exit_code

    assert [exit_code(c, True) for c in (0, 1, 2, 3, 4, 130, 143)] == [10, 11, 12, 13, 14, 130, 143]
    assert [exit_code(c, False) for c in (0, 1, 4)] == [0, 1, 4]


def test_a_journal_replays_once_and_keeps_an_ended_row_ended(tmp_path):
    """A replayed journal applies each entry once (a second process replaying the same file does nothing) and a
    journalled older state never re-opens a row another process has terminated since."""
    from broker.money.journal import replay

    db = tmp_path / "ledger.sqlite"
    lg = Ledger(db)
    lg.create_run(Run(id="r-j", name="x", status="running", created_at=utcnow()))
    a = lg.record_intent("r-j", "fake", "instance", "a", usd_per_hour=1.0)
    lg.mark_created(a.id, "i-a", state="running")
    entries = [{"id": "e1", "at": utcnow().isoformat(), "op": "update_resource", "args": [a.id],
                "kwargs": {"state": "running", "error": "stale"}, "why": "database is locked"},
               {"id": "e2", "at": utcnow().isoformat(), "op": "event", "args": ["r-j", "cli", "note", "hello"],
                "kwargs": {}, "why": "database is locked"}]
    lg.update_resource(a.id, state="terminated", actor="watchdog")
    (tmp_path / JOURNAL_NAME).write_text("".join(json.dumps(e) + "\n" for e in entries) + "not json\n")
    os.chmod(tmp_path / JOURNAL_NAME, 0o600)
    assert replay(lg) == 2
    assert lg.resource(a.id).state == "terminated"
    assert [e["message"] for e in lg.events("r-j") if e["action"] == "note"][0].startswith("hello [at ")
    assert replay(lg) == 0
    assert len([e for e in lg.events("r-j") if e["action"] == "note"]) == 1


WAITER = """
import os, sys, time
from pathlib import Path
d = Path(sys.argv[1])
(d / f"mid{os.environ['RANK']}").write_text("x")
end = time.monotonic() + 90
while not (d / "go").exists() and time.monotonic() < end:
    time.sleep(0.05)
print("JOB_OK", flush=True)
"""


def test_a_run_whose_ledger_is_locked_mid_job_still_tears_down_and_says_both_things(tmp_path, cli_env, broker_home):
    """The exact case on the run path: the ledger locked by another process from mid-job until after the job
    ended.  The run's machines are deleted (the fake cloud shows them terminated), the exit code is 10 (the job
    succeeded; the ledger could not record it), each unrecorded instance is named with its $/h, and the next
    command records the run's end and the deletes."""
    (tmp_path / "wait.py").write_text(WAITER)
    (tmp_path / "r.yaml").write_text(f"name: locked\nscript: wait.py\nargs: ['{tmp_path}']\nnodes: 2\ncpu_ok: true\n"
                                     "max_hours: 0.1\nexpect: [JOB_OK]\n")
    state = tmp_path / "fake.json"
    env = dict(cli_env, BROKER_FAKE_STATE=str(state))
    db = broker_home / "ledger.sqlite"
    proc = subprocess.Popen(broker_cmd("run", str(tmp_path / "r.yaml"), "--provider", "fake", "--yes"), env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 120
        while not all((tmp_path / f"mid{i}").exists() for i in (0, 1)):
            assert proc.poll() is None and time.monotonic() < end, proc.stdout.read() if proc.poll() is not None \
                else "the job did not start"
            time.sleep(0.05)
        with locked(db):
            (tmp_path / "go").write_text("go")
            out, _ = proc.communicate(timeout=180)
            assert proc.returncode == 10, out
            insts = json.loads(state.read_text())["instances"]
            assert insts and all(i["state"] == "terminated" for i in insts.values()), insts
            assert "JOB_OK" in out and "database is locked" in out
            assert "was deleted at the provider but the ledger still shows it live" in out
            assert "$1.00/h" in out or "$1.80/h" in out, out  # prices to the cent at least
            con = sqlite3.connect(str(db))
            (status,) = con.execute("SELECT status FROM runs").fetchone()
            con.close()
            assert status == "running"  # the ledger could not take the end
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    r = subprocess.run(broker_cmd("status", "--json"), env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    con = sqlite3.connect(str(db))
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "succeeded"
    assert {s for (s,) in con.execute("SELECT state FROM resources")} == {"terminated"}
    con.close()


FILLER = """
import os
rank = int(os.environ["RANK"])
print(f"rank {rank} writing a checkpoint", flush=True)
with open(f"ckpt{rank}.bin", "wb") as f:
    for _ in range(64):
        f.write(b"x" * (1 << 20))  # 64 MiB per rank into a 24 MiB filesystem: ENOSPC
"""


@needs_mount
def test_a_rented_run_that_fills_the_home_mid_job_still_deletes_its_machines_and_records_it(tmp_path, cli_env):
    """The exact case on a rented run: the job fills the filesystem holding the home.  The machines are deleted
    (the fake cloud, whose state lives elsewhere, shows them terminated) and the ledger records it through the space
    reserve; the run says the filesystem is full."""
    with _small_fs(tmp_path, 24) as home:
        job = tmp_path / "job"
        job.mkdir()
        (job / "filler.py").write_text(FILLER)
        (job / "r.yaml").write_text("name: filler\nscript: filler.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n")
        state = tmp_path / "fake.json"
        env = dict(cli_env, BROKER_HOME=str(home), BROKER_FAKE_STATE=str(state))
        p = subprocess.run(broker_cmd("run", str(job / "r.yaml"), "--provider", "fake", "--yes"), cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        out = p.stdout + p.stderr
        assert p.returncode in (1, 11), out
        insts = json.loads(state.read_text())["instances"]
        assert insts and all(i["state"] == "terminated" for i in insts.values()), (insts, out)
        con = sqlite3.connect(str(home / "ledger.sqlite"))
        status, message = con.execute("SELECT status, message FROM runs").fetchone()
        states = {s for (s,) in con.execute("SELECT state FROM resources")}
        con.close()
        if p.returncode == 1:  # the reserve made room: everything is in the ledger
            assert status == "failed" and states == {"terminated"}, (status, states, out)
            assert "is full" in (message or "") and "space reserve" in message
        else:  # not even the reserve sufficed: named, journalled (home or /tmp)
            assert "was deleted at the provider" in out


def test_stop_and_start_with_the_ledger_locked_after_the_provider_call(vast_emu, tmp_path):
    """`broker stop`: the ledger taken by another process right after the provider stopped the machine: the stop
    stands, `stopped` (the disk rate) is kept and journalled, and recorded once the lock is gone.  `broker start`
    with the ledger locked before its call starts nothing (ledger-first)."""
    from broker.cli.stopstart import start_run, stop_run
    from broker.money.journal import failsafe

    db = tmp_path / "ledger.sqlite"
    lg = Ledger(db)
    rid, iid = _vast_run(lg, vast_emu, "20261206-000000-st0p01")
    lg.update_run("20261206-000000-st0p01", status="succeeded", ended_at=utcnow())
    p = _vast(vast_emu)
    real_stop = p.stop
    holder: list = []

    def stop(pid, region=None):
        real_stop(pid, region=region)
        cm = locked(db)
        cm.__enter__()
        holder.append(cm)

    p.stop = stop
    try:
        rows = stop_run(failsafe(lg), "20261206-000000-st0p01", hours=5, poll_s=0.05, timeout_s=30,
                        providers={"vast": p})
        assert rows[0]["state"] == "stopped"
        assert ("PUT", f"/api/v0/instances/{iid}/", {"state": "stopped"}) in vast_emu.calls
        assert _states(db, "20261206-000000-st0p01") == ["stopping"]  # the ledger could not take `stopped`
        assert any(e["op"] == "change_rate" for e in Journal.read(tmp_path / JOURNAL_NAME))
        lg2 = Ledger(db)
        lg2._db.execute("PRAGMA busy_timeout=300")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            start_run(failsafe(lg2), "20261206-000000-st0p01", hours=1, poll_s=0.05, timeout_s=30,
                      providers={"vast": p}, ssh_check=False)
        assert not [c for c in vast_emu.calls if c[0] == "PUT" and c[2] == {"state": "running"}]
    finally:
        for cm in holder:
            cm.__exit__(None, None, None)
    lg3 = Ledger(db)  # the next command: replayed
    (row,) = lg3.resources("20261206-000000-st0p01")
    assert row.state == "stopped" and row.stopped_at is not None


@needs_mount
def test_the_watchdog_keeps_enforcing_on_a_full_home(vast_emu, tmp_path):
    """A full home made the watchdog's heartbeat write raise out of its loop: the process ended and nothing enforced
    the deadline.  Now it says so once and goes on: the instance past its deadline is deleted."""
    import threading
    from datetime import timedelta

    from broker.money.watchdog import Watchdog

    with _small_fs(tmp_path) as home:
        lg = Ledger(home / "ledger.sqlite")
        rid, iid = _vast_run(lg, vast_emu, "20261206-000000-wdfull", deadline=utcnow() + timedelta(seconds=2))
        _fill(home)
        wd = Watchdog(lg, providers={"vast": _vast(vast_emu)}, confirm_timeout_s=10, interval_s=0.2, home=home,
                      orphan_scan_s=3600)
        t = threading.Thread(target=wd.run_forever, daemon=True)
        t.start()
        try:
            end = time.monotonic() + 60
            while iid in vast_emu.instances and time.monotonic() < end and t.is_alive():
                time.sleep(0.1)
            assert t.is_alive(), "the watchdog ended on the full home"
            assert iid not in vast_emu.instances and vast_emu.deletes_of(iid) >= 1
        finally:
            wd.stop()
            t.join(timeout=30)
        lg.close()


def test_kept_writes_read_back_in_order_attrs_merged(tmp_path, monkeypatch):
    """While kept, the process reads what it wrote (state, provider id, attrs merged), and a later write queues
    behind an earlier kept one so the ledger never gets them out of order."""
    from broker.money import journal

    monkeypatch.setattr(journal, "BUSY_S", 0.2)
    db = tmp_path / "ledger.sqlite"
    lg = Ledger(db)
    lg.create_run(Run(id="r-k", name="x", status="running", created_at=utcnow()))
    a = lg.record_intent("r-k", "fake", "instance", "a", usd_per_hour=1.0, attrs={"node_index": 0})
    f = journal.failsafe(lg)
    with locked(db):
        f.mark_created(a.id, "i-a", state="creating", public_ip="203.0.113.9")
        f.update_resource(a.id, state="running", attrs={"provider_state": "running"})
        f.update_resource(a.id, state="terminated", attrs={"provider_state": "terminated"})
        got = f.resource(a.id)
        assert (got.provider_id, got.state) == ("i-a", "terminated")
        assert got.attrs == {"node_index": 0, "public_ip": "203.0.113.9", "provider_state": "terminated"}
        assert f.resources("r-k", live_only=True) == []
        assert lg.resource(a.id).state == "intent"
    assert f.retry()
    row = lg.resource(a.id)
    assert (row.provider_id, row.state, row.attrs["provider_state"]) == ("i-a", "terminated", "terminated")
    assert row.running_since is not None and row.terminated_at >= row.running_since


def test_a_locked_ledger_error_names_the_lock_not_the_folder(capsys, broker_home):
    from broker.cli.app import handle

    assert handle(sqlite3.OperationalError("database is locked"), as_json=False, args=["down"]) == 2
    err = capsys.readouterr().err
    assert "database is locked" in err and "another process holds the ledger's lock" in err
    assert "set BROKER_HOME" not in err


def test_a_preemption_while_the_ledger_is_locked_releases_and_rents_again_in_order(tmp_path, fake_cloud):
    """An interruptible run preempted while another process holds the ledger: the lost node's row, the attempt's
    end and the release are kept (nothing waits for the ledger), the next attempt is rented only once its rows can
    be written (ledger-first), and the kept writes land before it: attempt 1 owns only its own instance."""
    import threading

    from broker.providers.fake import FakeProvider
    from broker.run.pipeline import CloudTarget, Hooks, run_pipeline
    from tests.run.test_preempt import _recipe, _step
    from tests.support.plans import rank_options

    home = fake_cloud(tmp_path / "home", tmp_path / "fake.json")
    recipe, marker = _recipe(tmp_path, steps=30)
    p = FakeProvider()
    opts = [o for o in rank_options(p, recipe.requirements()) if o.topology.value == "simulated"]
    ledger = Ledger()
    db = home / "ledger.sqlite"
    took: list = []

    def preempt_locked() -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            live = [i for i, x in p.instances().items() if x["state"] == "running"]
            if live and _step(marker) >= 6:
                cm = locked(db)
                cm.__enter__()
                took.append(live[0])
                p.destroy(live[0])
                time.sleep(8)  # the CLI ends the attempt and releases meanwhile, without the ledger
                cm.__exit__(None, None, None)
                return
            time.sleep(0.05)

    t = threading.Thread(target=preempt_locked, daemon=True)
    t.start()
    said: list[str] = []
    out = run_pipeline(recipe, CloudTarget(recipe, opts, providers={"fake": p}, poll_s=0.1, monitor_s=0.2),
                       ledger=ledger, hooks=Hooks(say=said.append))
    t.join(timeout=30)
    assert took, "the job never reached the preemption point"
    assert out.exit_code == 0, (out.result.reason if out.result else None, said[-10:])
    assert any("cannot be written (database is locked)" in s for s in said), said
    rows = ledger.attempts(out.run.id)
    assert [a["cause"] for a in rows] == ["preempted", "succeeded"], rows
    res = {r.id: r for r in ledger.resources(out.run.id)}
    assert [res[i].provider_id for i in rows[0]["resource_ids"]] == [took[0]]
    assert all(r.state == "terminated" for r in res.values())
    assert all(i["state"] == "terminated" for i in p.instances().values())
    assert not (home / JOURNAL_NAME).exists() or (home / JOURNAL_NAME).stat().st_size == 0
