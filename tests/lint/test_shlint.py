"""Shell-script lint (broker/lint/shell.py): launch lines of any shell script, and the chapter's ``train_ddp.sh`` header
against a cluster's nodes as sinfo / scontrol report them (no daemons: the parsers get the commands' real output
shapes, Slurm 22.05)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from broker.lint.shell import (FATAL, ClusterNodes, check_against_cluster, lint_shell, parse_mem_mb, parse_minutes,
                           parse_scontrol_nodes, parse_sinfo_partitions, sbatch_directives)

BOOK = Path(__file__).resolve().parents[1] / "slurm_book"

SINFO = "broker*|2:01:00|2|node[0-1]\n"
SCONTROL = (
    "NodeName=node0 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 CPULoad=0.50 AvailableFeatures=(null) "
    "ActiveFeatures=(null) Gres=(null) NodeAddr=198.18.0.2 NodeHostName=node0 Version=22.05.8 OS=Linux "
    "RealMemory=23000 AllocMem=0 FreeMem=1000 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 "
    "Owner=N/A MCS_label=N/A Partitions=broker BootTime=None SlurmdStartTime=None\n"
    "NodeName=node1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 CPUTot=2 CPULoad=0.50 Gres=(null) NodeAddr=198.18.0.3 "
    "RealMemory=23000 State=IDLE Partitions=broker\n")


def cluster() -> ClusterNodes:
    return ClusterNodes(parse_sinfo_partitions(SINFO), parse_scontrol_nodes(SCONTROL), minutes_left=100.0)


def test_parsers_read_sinfo_scontrol_and_sbatch_units():
    c = cluster()
    assert c.partitions["broker"]["default"] and c.partitions["broker"]["nodes"] == 2
    assert c.partitions["broker"]["max_minutes"] == 121
    assert c.nodes["node1"] == {"cpus": 2, "memory_mb": 23000, "gpus": 0, "partitions": ["broker"]}
    g = parse_scontrol_nodes("NodeName=g0 CPUTot=64 RealMemory=512000 Gres=gpu:h200:8(S:0-1) Partitions=gpu\n")
    assert g["g0"]["gpus"] == 8
    assert parse_mem_mb("32G") == 32768 and parse_mem_mb("4096") == 4096 and parse_mem_mb("1T") == 1048576
    assert parse_minutes("00:30:00") == 30 and parse_minutes("1-02") == 26 * 60 and parse_minutes("90") == 90
    assert parse_minutes("UNLIMITED") == float("inf") and parse_minutes("x") is None
    ds = sbatch_directives("#!/bin/bash\n#SBATCH -N 2 -t 5\n#SBATCH --gres gpu:1\necho\n#SBATCH --mem=1G\n")
    assert [(d.line, d.name, d.value) for d in ds] == [(2, "nodes", "2"), (2, "time", "5"), (3, "gres", "gpu:1")]


def test_the_chapters_train_ddp_sh_has_each_problem_at_its_line():
    path = BOOK / "train_ddp.sh"
    text = path.read_text()
    found = lint_shell(text, "train_ddp.sh") + check_against_cluster(text, "train_ddp.sh", cluster())
    got = sorted((f.line, f.kind) for f in found)
    assert got == [(3, "sbatch-partition"), (6, "sbatch-gres"), (7, "sbatch-cpus"), (8, "sbatch-mem"),
                   (16, "shell-no-master-addr"), (18, "shell-rank-from-procid"),
                   (21, "sbatch-torchrun-not-srun")], got
    by = {f.kind: f for f in found}
    # what the cluster has, and the line to write instead
    assert "has no partition 'gpu' (it has: broker)" in by["sbatch-partition"].message
    assert "no GPUs" in by["sbatch-gres"].message and "Invalid generic resource" in by["sbatch-gres"].message
    assert "2 CPU(s)" in by["sbatch-cpus"].message and "--cpus-per-task=2" in by["sbatch-cpus"].fix
    assert "22.5 GiB" in by["sbatch-mem"].message and "--mem=" in by["sbatch-mem"].fix
    assert "scontrol show hostnames" in by["shell-no-master-addr"].fix
    assert "only the first node" in by["sbatch-torchrun-not-srun"].message
    assert {f.kind for f in found} - FATAL == {"shell-rank-from-procid"}  # a warning: the rest cannot run


def test_the_fixed_file_is_clean_on_the_same_cluster():
    text = (BOOK / "train_ddp_fixed.sh").read_text()
    assert lint_shell(text, "f.sh") == [] and check_against_cluster(text, "f.sh", cluster()) == []


def test_time_beyond_maxtime_refused_and_beyond_the_deadline_warned():
    c = cluster()
    f, = check_against_cluster("#!/bin/bash\n#SBATCH --time=3:00:00\n", "j.sh", c)
    assert f.kind == "sbatch-time" and f.line == 2 and "121 minute(s)" in f.message and f.kind in FATAL
    c.minutes_left = 20
    f, = check_against_cluster("#!/bin/bash\n#SBATCH --time=60\n", "j.sh", c)
    assert f.kind == "sbatch-time-deadline" and f.kind not in FATAL and "20 minute(s)" in f.message
    f, = check_against_cluster("#!/bin/bash\n#SBATCH --nodes=3\n", "j.sh", c)
    assert f.kind == "sbatch-nodes" and "has 2 node(s)" in f.message


def test_launch_lines_of_scripts_without_sbatch():
    # the node rank expanded by the calling shell: every node claims rank 0
    f, = lint_shell("#!/bin/bash\nsrun -N 2 torchrun --nnodes=2 --node_rank=$SLURM_NODEID "
                    "--master_addr=node0 t.py\n", "go.sh")
    assert (f.line, f.kind) == (2, "shell-node-rank-expanded-early")
    assert lint_shell("#!/bin/bash\nsrun -N 2 bash -c 'torchrun --nnodes=2 --node_rank=$SLURM_NODEID "
                      "--master_addr=node0 t.py'\n", "go.sh") == []
    f, = lint_shell("#!/bin/bash\ntorchrun --nnodes=2 --node_rank=$SLURM_NODEID t.py\n", "launch_torchrun.sh")
    assert f.kind == "shell-no-master-addr" and "127.0.0.1" in f.message
    # one-node torchrun: nothing to say; a comment silences a finding
    assert lint_shell("#!/bin/bash\nexport RANK=$SLURM_PROCID\ntorchrun --standalone --nproc_per_node=2 t.py\n",
                      "one.sh")[0].kind == "shell-rank-from-procid"
    assert lint_shell("#!/bin/bash\ntorchrun --standalone --nproc_per_node=2 t.py\n", "one.sh") == []
    assert lint_shell("#!/bin/bash\ntorchrun --nnodes=2 --node_rank=1 t.py  # broker-lint: ignore\n", "x.sh") == []


def test_broker_lint_checks_any_shell_script_and_says_so_when_clean(tmp_path):
    from broker.cli.app import app

    launch = tmp_path / "launch_torchrun.sh"
    launch.write_text("#!/bin/bash\ntorchrun --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID t.py\n")
    r = CliRunner().invoke(app, ["lint", str(launch)])
    assert r.exit_code == 1 and f"{launch}:2:" in r.output and "shell-no-master-addr" in r.output, r.output
    launch.write_text("#!/bin/bash\ntorchrun --nnodes=$SLURM_NNODES --node_rank=$SLURM_NODEID "
                      "--master_addr=$MASTER_ADDR --master_port=29500 t.py\n")
    r = CliRunner().invoke(app, ["lint", str(launch)])
    assert r.exit_code == 0 and "no findings" in r.output, r.output
    r = CliRunner().invoke(app, ["lint", str(BOOK / "train_ddp.sh")])
    assert r.exit_code == 1 and "train_ddp.sh:21:" in r.output and "train_ddp.sh:16:" in r.output


def test_broker_lint_on_a_directory_picks_up_launch_scripts(tmp_path):
    import json

    from broker.cli.app import app

    (tmp_path / "launch.sh").write_text("#!/bin/bash\nsrun -N 2 torchrun --nnodes=2 --node_rank=$SLURM_NODEID "
                                        "--master_addr=node0 t.py\n")
    (tmp_path / "tool.sh").write_text("#!/bin/bash\necho not a launcher\n")
    r = CliRunner().invoke(app, ["lint", str(tmp_path), "--json"])
    out = json.loads(r.output)
    assert [Path(f).name for f in out["files"]] == ["launch.sh"]
    assert [f["kind"] for f in out["findings"]] == ["shell-node-rank-expanded-early"] and r.exit_code == 1


# ------------------------------------------------------------------------------ slurm submit helpers (no daemons)
def test_output_patterns_are_expanded_as_sbatch_does():
    from broker.slurm.submit import expand_pattern

    assert expand_pattern("logs/%x-%j.out", job_id="42", name="train_ddp") == "logs/train_ddp-42.out"
    assert expand_pattern("/w/slurm-%5j-%u-%N.%%", job_id="42", name="x", node="node0") == "/w/slurm-00042-root-node0.%"


def test_labelled_lines_go_to_their_node_and_the_batch_shell_to_node_0(tmp_path):
    from broker.slurm.submit import Outcome, _Stream

    class Sh:  # the remote file, grown between pumps
        data = b""

        def read_from(self, path, offset):
            return self.data[offset:]

    sh = Sh()
    logs = {0: tmp_path / "node0.log", 1: tmp_path / "node1.log"}
    for p in logs.values():
        p.write_text("")
    shown = []
    from broker.slurm.submit import route_line

    def on_line(line):
        shown.append(route_line(line, logs, 1))

    s = _Stream(sh, "/remote.out", tmp_path / "job.out", on_line)
    sh.data = b"job 7 on node[0-1]\n0: rank 0\n1: ra"
    s.pump()
    sh.data += b"nk 1\x1b[2J\n"
    s.pump(final=True)
    assert logs[1].read_text() == "rank 1\x1b[2J\n" and "rank 0" in logs[0].read_text()
    assert "job 7" in logs[0].read_text() and (tmp_path / "job.out").read_bytes() == sh.data
    assert shown[0] == "[batch] job 7 on node[0-1]" and shown[1] == "[node 0] rank 0"
    assert shown[-1] == "[node 1] rank 1[2J"  # no control sequence reaches the terminal
    logs2 = {0: tmp_path / "a.log", 1: tmp_path / "b.log"}  # two tasks per node: tasks 2, 3 are node 1's
    for p in logs2.values():
        p.write_text("")
    assert route_line("3: x", logs2, 2) == "[node 1] x" and route_line("1: y", logs2, 2) == "[node 0] y"
    assert Outcome("r", "1", "COMPLETED", 0, 0, "succeeded").exit_status == 0
    assert Outcome("r", "1", "TIMEOUT", 0, 15, "failed").exit_status == 1


def test_diagnosis_names_torchrun_outside_srun_only_when_the_job_did_not_complete(tmp_path):
    from broker.run.supervisor import RunResult
    from broker.slurm.submit import Outcome, diagnose

    text = (BOOK / "train_ddp.sh").read_text()
    found = lint_shell(text, "train_ddp.sh")
    (tmp_path / "node0.log").write_text("job 2 on node[0-1]\n")
    (tmp_path / "node1.log").write_text("")
    logs = {0: tmp_path / "node0.log", 1: tmp_path / "node1.log"}
    out = Outcome("r", "2", "TIMEOUT", 0, 15, "failed", log_paths=logs)
    lines = diagnose(out, found, 2, tmp_path, RunResult("failed", {}, 0.0, logs))
    assert lines[0].startswith("only node 0 ever started: torchrun is not under srun (train_ddp.sh:21)")
    assert "no output from node 1" in lines[0] and "srun" in lines[1]
    ok = Outcome("r", "3", "COMPLETED", 0, 0, "succeeded", log_paths=logs)
    assert diagnose(ok, found, 2, tmp_path, RunResult("succeeded", {0: 0, 1: 0}, 0.0, logs)) == []


def test_python_in_the_batch_shell_of_a_multi_node_job(tmp_path):
    (tmp_path / "train.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    (tmp_path / "prep.py").write_text("print('data ready')\n")
    job = ("#!/bin/bash\n#SBATCH --nodes=2\npython prep.py\npython -u train.py --epochs 3\n"
           "srun python train.py\n")
    f, = lint_shell(job, str(tmp_path / "job.sh"))
    assert (f.line, f.kind) == (4, "sbatch-python-not-srun") and f.kind in FATAL and "train.py" in f.message
    assert lint_shell(job.replace("--nodes=2", "--nodes=1"), str(tmp_path / "job.sh")) == []


def test_the_catalogue_names_slurms_time_limit_with_the_srun_fix():
    from types import SimpleNamespace

    from broker.run.diagnose import explain

    d = Path(__file__).resolve().parents[1] / "diagnose_logs" / "cpu" / "slurm_time_limit"
    res = SimpleNamespace(status="failed", exit_codes={}, log_paths={0: d / "node0.log", 1: d / "node1.log"})
    diag = explain(d, res, 2)
    assert [f.entry.id for f in diag.findings] == ["slurm-time-limit"]
    text = "\n".join(diag.lines())
    assert "batch host node0" in text and "srun" in text and "--time" in text


def test_torchrun_under_srun_with_several_tasks_per_node():
    job = ("#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=4\n"
           "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\n"
           "srun bash -c 'torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$SLURM_NODEID "
           "--master_addr=$MASTER_ADDR t.py'\n")
    f, = lint_shell(job, "j.sh")
    assert (f.line, f.kind) == (5, "sbatch-torchrun-per-task") and "line 3" in f.message and f.kind in FATAL
    assert lint_shell(job.replace("srun bash", "srun --ntasks-per-node=1 bash"), "j.sh") == []


def test_the_sbatch_broker_renders_has_no_shell_finding():
    from broker.core.recipe import load_recipe
    from broker.slurm.executor import render_sbatch

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "ddp_2node.yaml")
    for gpus in (True, False):
        script = render_sbatch(recipe, log_dir="/tmp/logs", gpus=gpus)
        assert lint_shell(script, "rendered.sbatch") == []


def test_a_refused_option_that_srun_repeats_names_the_srun_line_too():
    from broker.core.recipe import load_recipe
    from broker.slurm.executor import render_sbatch

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "ddp_2node.yaml")
    script = render_sbatch(recipe, log_dir="slurm-logs", workdir=".")  # 1 GPU and 4 CPUs per node
    lines = script.splitlines()
    srun = next(i for i, ln in enumerate(lines, 1) if ln.startswith("STEP=(srun"))
    found = {f.kind: f for f in check_against_cluster(script, "job.sbatch", cluster())}
    gres, cpus = found["sbatch-gres"], found["sbatch-cpus"]
    assert lines[gres.line - 1] == "#SBATCH --gpus-per-node=1" and lines[cpus.line - 1] == "#SBATCH --cpus-per-task=4"
    assert f"job.sbatch:{srun} asks for it again (--gpus-per-node=1)" in gres.message
    assert f"job.sbatch:{srun} asks for it again (--cpus-per-task=4)" in cpus.message
    assert f"change the srun line ({srun}) too (--cpus-per-task=2)" in cpus.fix
    assert f"change the srun line ({srun}) too" in gres.fix
    # an srun line asking for what the nodes have is not named; an echo of srun is no srun line
    ok = ("#!/bin/bash\n#SBATCH --cpus-per-task=4\necho srun --cpus-per-task=4\nsrun --cpus-per-task=2 hostname\n")
    (f,) = check_against_cluster(ok, "ok.sh", cluster())
    assert "srun" not in f.message and "srun" not in f.fix


def test_a_cpu_only_recipe_renders_no_gpu_request(tmp_path):
    from broker.core.recipe import load_recipe
    from broker.slurm.executor import render_sbatch

    src = (Path(__file__).resolve().parents[2] / "recipes" / "ddp_2node.yaml").read_text()
    (tmp_path / "ddp_train.py").write_text("print('x')\n")
    (tmp_path / "cpu.yaml").write_text(src.replace("gpus_per_node: 1", "gpus_per_node: 0"))
    script = render_sbatch(load_recipe(tmp_path / "cpu.yaml"), log_dir="slurm-logs", workdir=".")
    assert "gpus-per-node" not in script and "#SBATCH --cpus-per-task=1" in script
    assert check_against_cluster(script, "job.sbatch", cluster()) == []


def test_a_loopback_master_on_a_multi_node_torchrun_line_is_named(tmp_path):
    for opt in ("--master_addr=localhost", "--master-addr 127.0.0.1", "--rdzv_endpoint=localhost:29500"):
        text = ("#!/bin/bash\nset -e\ntorchrun --nnodes=2 --nproc_per_node=1 --node_rank=$NODE_RANK \\\n"
                f"  {opt} --master_port=29500 train.py\n")
        (f,) = [f for f in lint_shell(text, "launch_torchrun.sh") if f.kind == "shell-no-master-addr"]
        assert f.line == 4 and opt.split()[0].split("=")[0] in f.message, (opt, f)
    # one node: localhost is right
    one = "#!/bin/bash\ntorchrun --nnodes=1 --nproc_per_node=2 --master_addr=localhost train.py\n"
    assert [f for f in lint_shell(one, "one.sh") if f.kind == "shell-no-master-addr"] == []
    # the CLI: `broker lint launch_torchrun.sh` exits non-zero and names it
    (tmp_path / "launch_torchrun.sh").write_text(
        "#!/bin/bash\ntorchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=localhost "
        "--master_port=29500 train.py\n")
    from broker.cli.app import app

    r = CliRunner().invoke(app, ["lint", str(tmp_path / "launch_torchrun.sh")])
    assert r.exit_code != 0 and "shell-no-master-addr" in r.output, r.output


def test_the_submit_stream_and_diagnosis_say_each_thing_once(tmp_path):
    from broker.run.supervisor import RunResult
    from broker.slurm.submit import Outcome, diagnose, end_message, is_stream_noise

    c10d = "[W1201 22:44:42.607 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3"
    assert is_stream_noise(f"[batch stderr] {c10d}") and is_stream_noise(f"[node 1] {c10d}")
    assert not is_stream_noise("[batch] job 1 on node[0-1]") and not is_stream_noise("[node 0] rank 0")
    # TIMEOUT of the book's launch: the srun paragraph once, not again as the catalogue's headline and cause
    d = Path(__file__).resolve().parents[1] / "diagnose_logs" / "cpu" / "slurm_time_limit"
    for f in d.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    found = lint_shell((BOOK / "train_ddp.sh").read_text(), "train_ddp.sh")
    logs = {0: tmp_path / "node0.log", 1: tmp_path / "node1.log"}
    for p in logs.values():
        if not p.exists():
            p.write_text("")
    out = Outcome("r", "1", "TIMEOUT", 0, 15, "failed", log_paths=logs)
    lines = diagnose(out, found, 2, tmp_path, RunResult("failed", {}, 0.0, logs, reason="Slurm job 1 TIMEOUT"))
    text = "\n".join(lines)
    assert text.count("only node 0 ever started") == 1
    assert text.count("runs on the first node only") <= 1 and "cause [slurm-time-limit]" not in text, text
    # the closing line names the state and exit code once
    f = Outcome("r", "7", "FAILED", 0, 53, "failed")
    assert end_message("7", f, "Slurm job 7 FAILED (JobLaunchFailure), ExitCode 0:53") == \
        "Slurm job 7 FAILED (JobLaunchFailure), ExitCode 0:53"
    assert end_message("7", f, "") == "Slurm job 7 FAILED, ExitCode 0:53"
