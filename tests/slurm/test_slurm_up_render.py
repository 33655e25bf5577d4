"""Unit tests of what `broker slurm up` renders and parses (slurm.conf, gres.conf, cloud-init for OCI/AWS, NFS,
node facts, sinfo) and of the pieces that need no cluster (stop by PID, lint advice, lookups)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.slurm import cluster as sc
from broker.slurm import render
from broker.core.provider import BadInput, ProviderError

REPO = Path(__file__).resolve().parents[2]


def nodes(gpus: tuple[int, ...] = (0, 0)) -> list[render.NodeFacts]:
    return [render.NodeFacts(name=f"node{i}", host=f"198.18.7.{10 + i}", private_ip=f"10.0.0.{10 + i}", hostname=f"h{i}",
                         cpus=4 + i, memory_mb=7900, gpus=g, gpu_devices=list(range(g))) for i, g in enumerate(gpus)]


def conf(ns: list[render.NodeFacts], **kw) -> str:
    return render.render_slurm_conf(cluster_name="bdemo", controller="h0", controller_addr="10.0.0.10", nodes=ns,
                                base="/srv/c1", munge_socket="/run/broker-munge-x/munge.socket",
                                spool_dir="/run/broker-slurmd-x", **kw)


def kv(text: str) -> dict[str, str]:
    return {ln.split("=", 1)[0]: ln.split("=", 1)[1] for ln in text.splitlines()
            if "=" in ln and not ln.startswith(("NodeName", "PartitionName"))}


def test_slurm_conf_node0_controller_real_counts_and_own_files():
    text = conf(nodes(), max_minutes=121)
    k = kv(text)
    assert k["SlurmctldHost"] == "h0(10.0.0.10)"
    assert k["AuthInfo"] == "socket=/run/broker-munge-x/munge.socket"
    for key in ("StateSaveLocation", "SlurmctldPidFile", "SlurmctldLogFile", "SlurmdPidFile", "SlurmdLogFile"):
        assert k[key].startswith("/srv/c1/"), key
    assert k["SlurmdSpoolDir"] == "/run/broker-slurmd-x/%n"  # short: slurmstepd sockets live there
    assert "%n" in k["SlurmdPidFile"]  # one pid file per node even on a shared file system
    lines = text.splitlines()
    assert "NodeName=node0 NodeAddr=10.0.0.10 CPUs=4 RealMemory=7900 State=UNKNOWN" in lines
    assert "NodeName=node1 NodeAddr=10.0.0.11 CPUs=5 RealMemory=7900 State=UNKNOWN" in lines
    assert "PartitionName=broker Nodes=node0,node1 Default=YES MaxTime=121 State=UP" in lines
    assert "GresTypes" not in text and "Gres=" not in text


def test_slurm_conf_gpus_and_gres_conf():
    ns = nodes((2, 1))
    text = conf(ns)
    assert "GresTypes=gpu" in text
    assert "NodeName=node0 NodeAddr=10.0.0.10 CPUs=4 RealMemory=7900 Gres=gpu:2 State=UNKNOWN" in text
    assert "Gres=gpu:1" in text and "MaxTime=INFINITE" in text
    assert render.render_gres_conf(ns) == ("NodeName=node0 Name=gpu File=/dev/nvidia[0,1]\n"
                                       "NodeName=node1 Name=gpu File=/dev/nvidia0\n")
    # a netns node that owns GPU 3 only (split GPUs) names that device
    ns[1].gpu_devices = [3]
    assert "NodeName=node1 Name=gpu File=/dev/nvidia3" in render.render_gres_conf(ns)
    assert render.render_gres_conf(nodes()) == ""


def test_slurm_conf_rejects_a_bad_cluster_name():
    with pytest.raises(BadInput):
        render.render_slurm_conf(cluster_name="bad name", controller="h", controller_addr="1.2.3.4", nodes=nodes(),
                             base="/b", munge_socket="/s", spool_dir="/run/x")


def test_parse_facts_counts_gpus_and_missing_binaries():
    out = ("NPROC=8\nMemTotal:       32768000 kB\nHOST=ip-10-0-0-10\nGPU=0, NVIDIA A10G\nGPU=1, NVIDIA A10G\n"
           "MISSING=slurmd\nMISSING=munged\n")
    f = render.parse_facts(out)
    assert f == {"cpus": 8, "memory_mb": 32000, "hostname": "ip-10-0-0-10",
                 "gpus": [(0, "NVIDIA A10G"), (1, "NVIDIA A10G")], "missing": ["slurmd", "munged"]}
    with pytest.raises(ProviderError):
        render.parse_facts("bash: nproc: command not found\n")


def test_facts_command_runs_here():
    out = subprocess.run(["sh", "-c", render.FACTS_CMD], capture_output=True, text=True).stdout
    f = render.parse_facts(out)
    assert f["cpus"] == os.cpu_count() and f["memory_mb"] > 100


def test_parse_sinfo_nodes():
    out = "node0|idle|2|(null)\nnode1|mixed*|8|gpu:2\nnode2|down~|4|gpu:a10:1,foo:3\n"
    assert render.parse_sinfo_nodes(out) == [
        {"name": "node0", "state": "idle", "cpus": 2, "gpus": 0},
        {"name": "node1", "state": "mixed", "cpus": 8, "gpus": 2},
        {"name": "node2", "state": "down", "cpus": 4, "gpus": 1}]


def test_cgroup_mount_script_v1_and_v2():
    v2 = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
    assert render.cgroup_mount_script(v2) == "mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup"
    v1 = ("tmpfs /sys/fs/cgroup tmpfs ro 0 0\n"
          "cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0\n"
          "cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0\n")
    s = render.cgroup_mount_script(v1)
    assert "mount -t tmpfs" in s and "mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory" in s
    assert "mount -t cgroup -o xattr,name=systemd cgroup /sys/fs/cgroup/systemd" in s


def state(tmp_path: Path, n: int = 2) -> render.ClusterState:
    return render.ClusterState(cluster_id="20260101-000000-abcdef", name="t", provider="netns", base=str(tmp_path / "c"),
                           shared_dir=str(tmp_path / "c" / "shared"), shared_note="", python=sys.executable,
                           ssh_key_path=str(tmp_path / "k"), known_hosts_path=str(tmp_path / "kh"), nodes=nodes(),
                           munge_socket="/run/broker-munge-abcdef/munge.socket", netns_cid="bkn123456")


def test_start_script_controller_only_on_node0(tmp_path):
    st = state(tmp_path)
    s0, s1 = render.start_script(st, 0, cgroups="CGROUPS"), render.start_script(st, 1, cgroups=None)
    assert f"slurmctld -i -f {st.conf}" in s0 and "slurmctld" not in s1
    assert f"slurmd -f {st.conf} -N node1" in s1 and "CGROUPS" in s0 and "CGROUPS" not in s1
    assert f"--key-file={st.node_dir(1)}/munge/munge.key" in s1 and "--socket=/run/broker-munge-abcdef" in s1
    assert s0.index("munged") < s0.index("slurmctld") < s0.index("slurmd -f")


def test_state_round_trip_holds_no_secret(tmp_path):
    st = state(tmp_path)
    st.save(tmp_path)
    again = render.ClusterState.load(tmp_path)
    assert again == st
    assert "key" not in {k for k in render.ClusterState.__dataclass_fields__ if k != "ssh_key_path"}
    with pytest.raises(BadInput):
        render.ClusterState.load(tmp_path / "nope")


def test_stop_script_stops_daemons_by_pid(tmp_path):
    """The real shell: TERM the pids in the pid files; one that ignores TERM gets KILL after the grace."""
    import shutil

    st = state(tmp_path)
    files = render.pid_files(st, 0)
    assert [Path(f).name for f in files] == ["slurmd.pid", "slurmctld.pid", "munged.pid"]
    bin_ = tmp_path / "bin"  # stand-ins named as the daemons (their /proc/PID/comm is what the script checks)
    bin_.mkdir()
    for name, real in (("slurmd", "sleep"), ("slurmctld", "sh"), ("munged", "sleep")):
        shutil.copy(shutil.which(real), bin_ / name)
    procs = [subprocess.Popen([str(bin_ / "slurmd"), "60"]),
             subprocess.Popen([str(bin_ / "slurmctld"), "-c", "trap '' TERM; while :; do sleep 0.1; done"]),
             subprocess.Popen([str(bin_ / "munged"), "60"])]
    stranger = subprocess.Popen(["sleep", "60"])  # not a daemon: a stale pid file naming it is left alone
    time.sleep(0.2)
    for f, p in zip(files, procs):
        Path(f).parent.mkdir(parents=True, exist_ok=True)
        Path(f).write_text(f"{p.pid}\n")
    try:
        out = subprocess.run(["sh", "-c", render.stop_script(st, 0, grace_s=1.0)], capture_output=True, text=True,
                             timeout=20).stdout
        for p in procs:
            p.wait(timeout=5)
        assert [p.returncode for p in procs] == [-15, -9, -15]
        assert out.split() == [f"STILL={procs[1].pid}", "STOPPED=3"]
        Path(files[0]).write_text(f"{stranger.pid}\n")  # slurmd ended; its pid now belongs to another program
        out = subprocess.run(["sh", "-c", render.stop_script(st, 0, grace_s=1.0)], capture_output=True, text=True,
                             timeout=20).stdout
        assert out.split() == ["STOPPED=0"] and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_nfs_server_script_exports_to_the_private_network_only():
    script = render.nfs_server_script("/srv/broker-shared", "10.0.0.0/24")
    assert ("echo '/srv/broker-shared 10.0.0.0/24(rw,sync,no_subtree_check,no_root_squash)' > "
            "/etc/exports.d/broker.exports") in script
    assert script.startswith("set -e;") and script.endswith("exportfs -ra")


def test_nfs_client_script_mounts_node0_at_the_same_path():
    mount = render.nfs_client_script("10.0.0.10", "/srv/broker-shared")
    assert mount.startswith("set -e; mkdir -p /srv/broker-shared;")
    assert "mount -t nfs" in mount and "10.0.0.10:/srv/broker-shared /srv/broker-shared" in mount
    assert mount.endswith("mountpoint -q /srv/broker-shared")  # the step fails when it never mounted


def test_cloud_onstart_and_nfs_scripts_are_valid_shell():
    for script in (render.cloud_onstart(), render.nfs_server_script("/srv/broker-shared", "10.0.0.0/24"),
                   render.nfs_client_script("10.0.0.10", "/srv/broker-shared")):
        assert subprocess.run(["sh", "-n", "-c", script]).returncode == 0
    on = render.cloud_onstart()
    assert "apt-get install -y -q slurm-wlm munge nfs-kernel-server nfs-common" in on
    assert "systemctl disable --now slurmd slurmctld" in on
    assert "10.0.0.0/24(rw" in render.nfs_server_script("/srv/broker-shared", "10.0.0.0/24")


def test_private_cidr():
    assert render.private_cidr(["10.0.3.7", "10.0.3.9"]) == "10.0.3.0/24"
    assert render.private_cidr(["172.31.5.1", "172.31.9.1"]) == "172.31.0.0/16"


def test_node0_shell_runs_commands_with_the_clusters_conf(tmp_path):
    st = state(tmp_path)
    sh = sc.node0_shell(st)
    argv = sh.argv(["sinfo", "-h"])
    assert argv[0] == "ssh" and argv[-5:-1] == ["-l", "root", "--", "198.18.7.10"]  # never read as an option
    assert f"-i" in argv and st.ssh_key_path in argv and f"UserKnownHostsFile={st.known_hosts_path}" in argv
    assert argv[-1].startswith(f"export SLURM_CONF={st.conf} TMPDIR={st.shared_dir}/tmp; ") and \
        argv[-1].endswith("sinfo -h")


def test_cpu_lint_advice_on_cpu_nodes_only(tmp_path):
    from broker.cli.slurm import cpu_lint_advice
    from broker.core.recipe import load_recipe

    (tmp_path / "train.py").write_text("import torch.distributed as dist\ndist.init_process_group(backend='nccl')\n")
    (tmp_path / "r.yaml").write_text("name: r\nscript: train.py\ncpu_ok: true\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    st = state(tmp_path)
    advice = cpu_lint_advice(recipe, st)
    assert len(advice) == 1 and "train.py:2" in advice[0] and "'gloo'" in advice[0]
    st.nodes[0].gpus = 1
    assert cpu_lint_advice(recipe, st) == []
    assert cpu_lint_advice(load_recipe(REPO / "recipes" / "ddp_2node.yaml"), state(tmp_path)) == []


def test_run_on_an_unknown_or_ended_cluster_is_refused(tmp_path):
    from broker.money.ledger import Ledger
    from broker.core.records import Run
    from broker.slurm.executor import SlurmOptions

    led = Ledger()
    with pytest.raises(BadInput, match="no Slurm cluster"):
        sc.attach(SlurmOptions(cluster="nope"), led)
    from broker.core.config import runs_dir

    run_dir = runs_dir() / "20260101-000000-abcdef"  # a run's folder is only ever <home>/runs/<run id>
    run_dir.mkdir()
    state(tmp_path).save(run_dir)
    led.create_run(Run(id="20260101-000000-abcdef", name="slurm-t", provider="netns", topology=sc.TOPOLOGY,
                       status="torn_down", run_dir=str(run_dir)))
    with pytest.raises(BadInput, match="not up"):
        sc.attach(SlurmOptions(cluster="20260101-000000-abcdef"), led)
    led.update_run("20260101-000000-abcdef", status="running")
    opts = SlurmOptions(cluster="20260101-000000-abcdef")
    prov = sc.attach(opts, led)
    assert opts.remote_base == f"{tmp_path}/c/shared/jobs" and opts.python == sys.executable
    # the job row names node 0 as a login (what the row schema takes); commands go through the cluster's shell
    assert opts.host.endswith("@198.18.7.10") and prov.host == opts.host and prov.shell.argv(["true"])[0] == "ssh"
    # `broker down JOB_RUN` (a plain SlurmProvider) reaches a job on the cluster through its node 0
    from broker.providers.slurm import SlurmProvider

    sh = SlurmProvider()._shell_for({"host": opts.host, "cluster": "20260101-000000-abcdef"})
    assert sh.argv(["scancel", "7"])[-2:] == ["198.18.7.10", f"export SLURM_CONF={tmp_path}/c/etc/slurm.conf "
                                                                   f"TMPDIR={tmp_path}/c/shared/tmp; scancel 7"]


def test_slurm_up_on_a_cloud_without_credentials_creates_nothing(cli_env, broker_home):
    cp = subprocess.run([sys.executable, "-m", "broker", "slurm", "up", "--provider", "aws", "--nodes", "2",
                         "--yes"], cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=120)
    assert cp.returncode != 0 and "credentials" in cp.stderr.lower()
    from broker.money.ledger import Ledger

    assert Ledger().list_runs(limit=10) == []


def test_slurm_up_rejects_an_unknown_provider(cli_env):
    cp = subprocess.run([sys.executable, "-m", "broker", "slurm", "up", "--provider", "vast"], cwd=REPO, env=cli_env,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and "netns, oci, aws" in cp.stderr


def test_spool_is_short_whatever_the_run_folder(tmp_path):
    """slurmstepd's socket ``<spool>/<node>_<job>.<step>`` must fit in 108 bytes (a deep pytest run folder made
    the batch step fail and Slurm requeue and hold the job)."""
    st = state(tmp_path / ("deep" * 20))
    sock = f"{st.spool_dir}/node0/node0_123456.4294967291"
    assert len(sock) < 108
    assert f"SlurmdSpoolDir={st.spool_dir}/%n" in render.render_slurm_conf(
        cluster_name="b", controller="node0", controller_addr="1.2.3.4", nodes=nodes(), base=st.base,
        munge_socket=st.munge_socket, spool_dir=st.spool_dir)


def test_a_job_held_after_a_failed_launch_is_hopeless():
    from broker.providers.slurm import JobInfo

    assert JobInfo("1", "PENDING", reason="launch failed requeued held").hopeless
    assert not JobInfo("1", "PENDING", reason="Resources").hopeless
