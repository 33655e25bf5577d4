"""broker.providers.slurm against stand-in Slurm commands (output formats as Slurm 22.05 prints them)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from broker.slurm.executor import LogFollower
from broker.providers.slurm import JobInfo, Shell, SlurmProvider, parse_exit_code, parse_scontrol_job


def fake_bin(tmp_path: Path, monkeypatch, **scripts: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (d / name).write_text("#!/bin/bash\n" + body)
        (d / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    return d


SCONTROL_JOB = ("JobId=12 JobName=ddp UserId=root(0) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) "
                "ExitCode=1:0 RunTime=00:00:09 NodeList=node[0-1] BatchHost=node0 NumNodes=2")


def test_parsers():
    kv = parse_scontrol_job(SCONTROL_JOB)
    assert kv["JobState"] == "FAILED" and kv["NodeList"] == "node[0-1]" and kv["ExitCode"] == "1:0"
    assert parse_exit_code("0:15") == (0, 15) and parse_exit_code("") == (None, None)


def test_final_state_from_sacct(tmp_path, monkeypatch):
    fake_bin(tmp_path, monkeypatch,
             squeue="exit 0\n",  # job left the queue
             sacct='echo "12|CANCELLED by 0|0:15|node[0-1]"\n',
             scontrol='[ "$1 $2" = "show hostnames" ] && { echo node0; echo node1; exit 0; }; exit 1\n')
    info = SlurmProvider().job("12")
    assert info == JobInfo("12", "CANCELLED", 0, 15, ["node0", "node1"], source="sacct")
    assert info.done


def test_final_state_falls_back_to_scontrol_without_accounting(tmp_path, monkeypatch):
    fake_bin(tmp_path, monkeypatch,
             squeue="exit 0\n",
             sacct='echo "sacct: error: Slurm accounting storage is disabled" >&2; exit 1\n',
             scontrol=f'[ "$1 $2" = "show hostnames" ] && {{ echo node0; echo node1; exit 0; }}\n'
                      f'[ "$1 $2 $3 $4" = "show job -o 12" ] && echo {shlex.quote(SCONTROL_JOB)}\n')
    info = SlurmProvider().job("12")
    assert (info.state, info.exit_code, info.nodes, info.source) == ("FAILED", 1, ["node0", "node1"], "scontrol")


def test_running_and_hopeless_states_from_squeue(tmp_path, monkeypatch):
    fake_bin(tmp_path, monkeypatch, squeue='echo "PENDING|(PartitionConfig)"\n')
    info = SlurmProvider().job("7")
    assert (info.state, info.reason, info.done, info.hopeless) == ("PENDING", "PartitionConfig", False, True)
    fake_bin(tmp_path, monkeypatch, squeue='echo "PENDING|(Resources)"\n')
    assert not SlurmProvider().job("7").hopeless


def test_partition_nodes_and_gpus(tmp_path, monkeypatch):
    fake_bin(tmp_path, monkeypatch, sinfo='''case "$*" in
  "-h -o %P %D") printf 'debug* 2\\ndebug* 3\\ngpu 4\\n';;
  "-h -o %G") printf '(null)\\ngpu:a100:4(S:0-1)\\n';;
  "-h -o %G -p debug") printf '(null)\\n';;
esac
''')
    p = SlurmProvider()
    assert p.partition_nodes() == 5 and p.partition_nodes("gpu") == 4 and p.partition_nodes("nope") is None
    assert p.has_gpus() is True and p.has_gpus("debug") is False


def test_submit_parses_parsable_output_and_tags_the_run(tmp_path, monkeypatch):
    fake_bin(tmp_path, monkeypatch, sbatch=f'echo "$*" > {tmp_path}/args; echo "4711;cluster1"\n')
    assert SlurmProvider().submit("/x/job.sbatch", run_id="r1") == "4711"
    assert (tmp_path / "args").read_text().split() == ["--parsable", "--comment=broker-run=r1", "/x/job.sbatch"]


def test_ssh_shell_quotes_the_remote_command():
    sh = Shell("alice@login")
    argv = sh.argv(["tail", "-c", "+5", "/home/a b/log's.out"])
    assert argv[0] == "ssh" and argv[-2] == "alice@login" and "BatchMode=yes" in argv
    assert shlex.split(argv[-1]) == ["tail", "-c", "+5", "/home/a b/log's.out"]


def test_missing_client_is_a_provider_error(monkeypatch, tmp_path):
    from broker.core.provider import ProviderError

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ProviderError, match="squeue is not installed"):
        SlurmProvider().job("1")
    assert SlurmProvider().check().usable is False


def test_log_follower_keeps_partial_lines(tmp_path):
    remote, local = tmp_path / "remote.out", tmp_path / "node1.log"
    seen: list[str] = []
    f = LogFollower(Shell(), seen.append)
    f.add("node 1", str(remote), local)
    f.pump()  # file not there yet
    remote.write_bytes(b"RANK=1 start\npart")
    f.pump()
    assert seen == ["[node 1] RANK=1 start"]
    with open(remote, "ab") as out:
        out.write(b"ial line\nlast without newline")
    f.pump()
    f.pump(final=True)
    assert seen[1:] == ["[node 1] partial line", "[node 1] last without newline"]
    assert local.read_text() == "RANK=1 start\npartial line\nlast without newline\n"


def test_no_cluster_configured_says_how_to_reach_one(tmp_path, monkeypatch):
    """Slurm installed but no slurm.conf: the error named only sinfo's DNS SRV noise; it must say what to do."""
    from broker.core.provider import ProviderError

    fake_bin(tmp_path, monkeypatch, sinfo=(
        'echo "sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host" >&2\n'
        'echo "sinfo: fatal: Could not establish a configuration source" >&2\nexit 1\n'))
    with pytest.raises(ProviderError) as ei:
        Shell().text(["sinfo", "-h"], call="sinfo")
    assert "no Slurm cluster is reachable on this machine" in ei.value.hint and "--slurm-host" in ei.value.hint
