"""Diagnosis of real failures: every catalogue entry against a log excerpt captured by running the fault
(tests/diagnose_logs/cpu: real torchrun on CPU/gloo through broker's local launcher and the rank-facts shim,
scripts/capture_diagnose_logs.py; tests/diagnose_logs/gpu: real torchrun on 2x H200,
bench/results/h200x2_diagnose_capture.txt)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from broker.run.diagnose import Diagnosis, catalogue, error_lines, explain, load_facts
from broker.run.supervisor import RunResult, finish_result, rank_table

LOGS = Path(__file__).resolve().parents[1] / "diagnose_logs"
CPU, GPU = LOGS / "cpu", LOGS / "gpu"

#: what broker's supervisor recorded on the GPU host (node that exited first, the other stopped with SIGTERM)
GPU_CODES = {"bad_device": {0: -15, 1: 1}, "timeout": {0: 1, 1: -15}, "early_exit": {0: 1, 1: 0},
             "nccl_no_gpu": {0: 1, 1: 1}}


def cpu_case(name: str) -> tuple[Path, SimpleNamespace]:
    d = CPU / name
    r = json.loads((d / "result.json").read_text())
    res = SimpleNamespace(status=r["status"], exit_codes={int(k): v for k, v in r["exit_codes"].items()},
                          log_paths={int(p.stem[4:]): p for p in d.glob("node*.log")})
    return d, res


def diagnose_cpu(name: str) -> Diagnosis:
    d, res = cpu_case(name)
    return explain(d, res, 2)


def diagnose_gpu(name: str) -> Diagnosis:
    res = SimpleNamespace(status="failed", exit_codes=GPU_CODES[name],
                          log_paths={i: GPU / f"{name}.node{i}.log" for i in (0, 1)})
    return explain(GPU, res, 2)


def diagnose_gpu_case(name: str) -> Diagnosis:
    """A GPU case laid out as the CPU ones (a folder with result.json, node logs and rank facts)."""
    d = GPU / name
    r = json.loads((d / "result.json").read_text())
    res = SimpleNamespace(status=r["status"], exit_codes={int(k): v for k, v in r["exit_codes"].items()},
                          log_paths={int(p.stem[4:]): p for p in d.glob("node*.log")})
    return explain(d, res, 2)


def ids(d: Diagnosis) -> list[str]:
    return [f.entry.id for f in d.findings]


def test_catalogue_is_data_with_every_field():
    entries = catalogue()
    assert len({e.id for e in entries}) == len(entries) >= 11
    for e in entries:
        assert e.cause and e.fix and e.caught_by and e.verified, e.id
        assert e.patterns or e.facts, e.id


def test_invalid_device_ordinal_on_gpu_names_node_1_and_the_users_line():
    d = diagnose_gpu("bad_device")
    assert ids(d)[0] == "invalid-device-ordinal"
    assert d.first.node == 1 and d.first.rank == 1
    assert "invalid device ordinal" in d.first.error()
    assert d.first.frame["code"] == 'torch.cuda.set_device(int(os.environ["RANK"]))'
    text = "\n".join(d.lines())
    assert "node 1, rank 1 failed first" in text and "LOCAL_RANK" in text and "ChildFailedError" not in text
    assert "lint rule device-from-rank" in text


def test_shim_facts_on_gpu_table_and_first_failure():
    """The shim on 2x H200: the table's device, backend and versions come from the facts of an unchanged script."""
    d = GPU / "shim_ok"
    rows = rank_table({i: d / f"node{i}.log" for i in (0, 1)}, nnodes=2, nproc_per_node=1)
    assert [(r.node, r.rank, r.cuda_visible_devices, r.gpus, r.device, r.backend) for r in rows] == \
        [(0, 0, "0", "1", "cuda:0", "nccl"), (1, 1, "1", "1", "cuda:0", "nccl")]
    assert {(r.torch, r.cuda, r.nccl, r.python) for r in rows} == {("2.11.0+cu130", "13.0", "2.28.9", "3.12.3")}
    b = GPU / "shim_bad_device"
    res = SimpleNamespace(status="failed", exit_codes={0: -15, 1: 1},
                          log_paths={i: b / f"node{i}.log" for i in (0, 1)})
    diag = explain(b, res, 2)
    assert diag.first.node == 1 and diag.first.rank == 1 and diag.first.source == "facts"
    assert diag.first.frame == {"file": "g.py", "line": 4, "function": "<module>",
                                "code": 'torch.cuda.set_device(int(os.environ["RANK"]))'}
    assert load_facts(b)[1]["device"] == "cuda:1"  # the device the rank asked for, recorded before it failed
    assert ids(diag)[0] == "invalid-device-ordinal"


def test_nccl_timeout_on_gpu_names_the_rank_that_never_arrived():
    d = diagnose_gpu("timeout")
    assert ids(d)[0] == "collective-timeout"
    assert d.first.node == 0 and d.first.exit_code == -6  # the waiting rank is aborted by the NCCL watchdog
    assert d.behind == [1]
    assert "SeqNum=2, OpType=ALLREDUCE" in d.findings[0].cause
    assert d.first.exc_type == "c10::DistBackendError" and "Watchdog caught collective operation timeout" \
        in d.first.message  # the abort's what(), not just "exit code -6"


def test_rank_that_exits_early_is_the_cause_on_gpu_and_cpu():
    g = diagnose_gpu("early_exit")
    assert g.early_exits and g.early_exits[0]["node"] == 1
    assert g.headline.startswith("node 1 (its torchrun and ranks) exited 0 before a collective")
    c = diagnose_cpu("early_exit")
    assert c.early_exits == [{"node": 1, "rank": 1, "at": c.early_exits[0]["at"]}]
    assert c.first.node == 0 and "Connection closed by peer" in c.first.message
    assert "peer-gone" in ids(c)
    assert c.lines()[0].startswith("node 1, rank 1 exited 0 before a collective")
    assert c.lines()[1].startswith("then node 0, rank 0 failed: RuntimeError")


def test_a_rank_that_finished_is_not_blamed_for_a_peers_own_error(tmp_path):
    """Rank 1 exited 0 first, but rank 0 then failed on its own (not waiting for a peer): rank 0 is the cause."""
    shutil.copytree(CPU / "early_exit", tmp_path / "run")
    f = tmp_path / "run" / "node0" / "facts" / "rank0.json"
    facts = json.loads(f.read_text())
    facts["exception"] = {"type": "ValueError", "message": "bad eval batch", "frame": None}
    f.write_text(json.dumps(facts))
    for log in (tmp_path / "run").glob("node*.log"):
        log.write_text("")
    res = SimpleNamespace(status="failed", exit_codes={0: 1, 1: 0}, log_paths={})
    d = explain(tmp_path / "run", res, 2)
    assert d.early_exits == [] and d.headline == "node 0, rank 0 failed first: ValueError: bad eval batch"


def test_nccl_without_gpu_on_cpu_build_and_on_gpu_host_with_no_visible_gpu():
    c = diagnose_cpu("nccl_no_gpu")
    assert ids(c)[0] == "nccl-without-gpu" and "doesn't have NCCL built in" in c.first.message
    g = diagnose_gpu("nccl_no_gpu")
    assert ids(g)[0] == "nccl-without-gpu" and "only supported with GPUs" in g.first.message


def test_master_port_in_use_names_torchruns_own_error():
    d = diagnose_cpu("eaddrinuse")
    assert ids(d)[0] == "master-port-in-use"
    assert d.first.node == 0 and "EADDRINUSE" in d.first.message and "torchrun on node 0" in d.first.exc_type


def test_loopback_address_from_hostname_in_netns():
    d = diagnose_cpu("loopback_refused")
    assert ids(d)[0] == "loopback-address"
    assert d.findings[0].what == "127.0.1.1"


def test_interface_not_found():
    d = diagnose_cpu("iface_not_found")
    assert ids(d)[0] == "interface-not-found" and d.findings[0].what == "bogus0"
    assert d.first.node == 1 and d.first.frame["file"] == "fault.py"


def test_gloo_unsupported_operation():
    d = diagnose_cpu("gloo_unsupported")
    assert ids(d)[0] == "gloo-unsupported"
    assert d.first.frame["code"].startswith("dist.all_reduce(torch.ones(4).to_sparse()")


def test_gloo_timeout():
    d = diagnose_cpu("gloo_timeout")
    assert ids(d)[0] == "collective-timeout" and "Timed out waiting 5000ms" in d.first.message


def test_duplicate_ranks_from_slurm_procid():
    d = diagnose_cpu("slurm_procid")
    assert ids(d)[0] == "duplicate-rank"
    assert "rank 0 given to init_process_group by node 0 (RANK=0), node 1 (RANK=1)" in d.findings[0].cause


def test_disk_full():
    d = diagnose_cpu("disk_full")
    assert ids(d)[0] == "disk-full" and d.first.node == 0 and d.first.frame["function"] == "<module>"


def test_killed_by_sigkill():
    d = diagnose_cpu("sigkill")
    assert ids(d)[0] == "killed-sigkill"
    assert d.first.node == 1 and d.first.exit_code == -9 and "SIGKILL" in d.first.error()


def test_torch_version_skew_from_rank_facts(tmp_path):
    """Facts of the real 'ok' run, with node 1's torch changed (one torch build here): the skew is named."""
    shutil.copytree(CPU / "ok", tmp_path / "run")
    f = tmp_path / "run" / "node1" / "facts" / "rank1.json"
    facts = json.loads(f.read_text())
    facts["torch"] = "2.11.0+cu130"
    f.write_text(json.dumps(facts))
    res = SimpleNamespace(status="failed", exit_codes={0: 1, 1: 1}, log_paths={})
    d = explain(tmp_path / "run", res, 2)
    assert ids(d)[0] == "torch-version-skew"
    assert "node 0: 2.13.0+cpu, node 1: 2.11.0+cu130" in d.findings[0].cause


def test_every_catalogue_entry_is_matched_by_a_real_excerpt(tmp_path):
    """Each entry is the first finding on at least one captured excerpt (skew: on the real facts, edited)."""
    got = set()
    for name in ("eaddrinuse", "loopback_refused", "iface_not_found", "gloo_unsupported", "nccl_no_gpu",
                 "gloo_timeout", "early_exit", "slurm_procid", "disk_full", "sigkill", "world_size4", "shapes",
                 "slow_rank", "cuda_on_cpu", "no_torch", "ddp_unused", "ddp_models", "tcp_localhost", "master_env",
                 "slurm_time_limit"):
        got.update(ids(diagnose_cpu(name)))
    for name in GPU_CODES:
        got.update(ids(diagnose_gpu(name)))
    got.update(ids(diagnose_gpu_case("dup_gpu")))
    test_torch_version_skew_from_rank_facts(tmp_path)
    got.add("torch-version-skew")
    assert got >= {e.id for e in catalogue()}, sorted({e.id for e in catalogue()} - got)


# ------------------------------------------------------------------------------------------------ the run's own view
def test_rank_table_from_facts_without_the_scripts_print_line():
    d, res = cpu_case("ok")
    assert "RANK=" not in "".join(p.read_text() for p in res.log_paths.values())
    rows = rank_table(res.log_paths, nnodes=2, nproc_per_node=1)
    assert [(r.node, r.rank, r.local_rank, r.world_size, r.device, r.backend, r.cuda_visible_devices)
            for r in rows] == [(0, 0, 0, 2, "cpu", "gloo", "''"), (1, 1, 0, 2, "cpu", "gloo", "''")]
    assert rows[0].host != "?" and rows[0].torch.startswith("2.13") and rows[0].python.count(".") == 2


def test_rank_table_falls_back_to_the_print_line(tmp_path):
    log = tmp_path / "node0.log"
    log.write_text("RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 device=cuda:0 backend=nccl\n")
    (row,) = rank_table({0: log}, nnodes=1, nproc_per_node=1)
    assert (row.device, row.backend, row.host) == ("cuda:0", "nccl", "?")


def test_success_with_error_lines_is_shown_as_succeeded_with_errors():
    d, res = cpu_case("succeeded_with_errors")
    rr = RunResult(status="succeeded", exit_codes=res.exit_codes, wall_s=1.0, log_paths=res.log_paths)
    rr = finish_result(rr, [], nnodes=2, nproc_per_node=1)
    assert rr.ok and rr.status == "succeeded" and rr.shown_status == "succeeded with errors"
    assert any("ERROR: sparse all_reduce failed on rank 1" in ln for ln in rr.error_lines)
    assert any(ln.startswith("node 0: Traceback") and "RuntimeError" in ln for ln in rr.error_lines)
    assert "error line(s)" in rr.reason
    text = explain(d, rr, 2).lines()
    assert text[0] == "every node exited 0, but the ranks printed errors:"
    clean = RunResult(status="succeeded", exit_codes={0: 0, 1: 0}, wall_s=1.0,
                      log_paths=cpu_case("ok")[1].log_paths)
    clean = finish_result(clean, [], nnodes=2, nproc_per_node=1)
    assert clean.shown_status == "succeeded" and clean.error_lines == []


def test_exit_barrier_noise_is_not_an_error(tmp_path):
    log = tmp_path / "node1.log"
    log.write_text("E1130 12:00:00 api.py:1] Error waiting on exit barrier. Elapsed: 0.1 seconds\n"
                   "Traceback (most recent call last):\n  File \"x\", line 1\nERROR waiting on exit barrier\n")
    assert error_lines({1: log}) == []


def test_load_facts_sorted_by_rank():
    facts = load_facts(CPU / "early_exit")
    assert [f["rank"] for f in facts] == [0, 1] and facts[1]["exit_code"] == 0 and facts[0]["exception"]


@pytest.mark.parametrize("case", ["ok", "succeeded_with_errors", "sigkill", "eaddrinuse"])
def test_summary_prints_table_and_diagnosis(case, capsys, monkeypatch):
    from broker.cli import summary

    d, res = cpu_case(case)
    rr = RunResult(status=res.status, exit_codes=res.exit_codes, wall_s=1.0, log_paths=res.log_paths)
    rr = finish_result(rr, [], nnodes=2, nproc_per_node=1)
    run = SimpleNamespace(id="r1", name="t", topology="local", provider="local", run_dir=str(d))
    summary.render_summary(run, rr, SimpleNamespace(nodes=2))
    out = capsys.readouterr().out
    if case != "eaddrinuse":
        assert "gloo" in out and "every rank: Python" in out and "no rank reported in" not in out
    if case == "ok":
        assert "status: succeeded" in out and "diagnosis" not in out
    elif case == "succeeded_with_errors":
        assert "status: succeeded with errors" in out and "ERROR: sparse all_reduce" in out
    elif case == "sigkill":
        assert "node 1, rank 1 failed first" in out and "killed-sigkill" in out
    else:
        assert "master-port-in-use" in out and "EADDRINUSE" in out


def _no_rank_summary(tmp_path, capsys, result) -> str:
    from broker.cli import summary

    run = SimpleNamespace(id="r1", name="ddp-2node", topology="hybrid", provider="netns", run_dir=str(tmp_path))
    summary.render_summary(run, result, SimpleNamespace(nodes=2))
    return " ".join(capsys.readouterr().out.split())  # rich may wrap long lines


def test_summary_after_a_failed_preflight_says_so_and_points_to_the_report(tmp_path, capsys):
    """The trial's summary ended mid-sentence ("...: no rank reported in") and listed empty node logs; after a
    failed preflight it says no rank started because of it and points to preflight.txt."""
    from broker.run.remote import RemoteRunResult

    logs = {i: tmp_path / f"node{i}.log" for i in range(2)}
    for p in logs.values():
        p.write_text("")
    (tmp_path / "preflight.txt").write_text("FAIL tcp 0->1 29500: refused\n")
    res = RemoteRunResult(status="failed", exit_codes={}, wall_s=3.0, log_paths=logs,
                          reason="preflight failed: tcp 0->1", preflight=SimpleNamespace(ok=False))
    out = _no_rank_summary(tmp_path, capsys, res)
    assert "ddp-2node (hybrid on netns): no rank started: preflight failed" in out, out
    assert "no rank reported in" not in out
    assert f"preflight report (why no rank started): {tmp_path / 'preflight.txt'}" in out, out
    assert "node0.log" not in out and "node1.log" not in out  # empty: not listed
    assert "node logs: none written" in out


@pytest.mark.parametrize("codes, status, text", [
    ({}, "interrupted", "interrupted (Ctrl-C) before any rank started"),
    ({0: -2, 1: -2}, "interrupted", "interrupted (Ctrl-C) before any rank reported"),
    ({0: 1, 1: None}, "failed", "the nodes exited before any rank reported"),
    ({}, "failed", "no rank started: the run stopped before launch"),
    ({0: None, 1: None}, "deadline", "the deadline passed before any rank reported"),
])
def test_summary_without_ranks_is_a_whole_true_sentence(tmp_path, capsys, codes, status, text):
    logs = {0: tmp_path / "node0.log", 1: tmp_path / "node1.log"}
    logs[0].write_text("[W] torchrun starting\n")
    logs[1].write_text("")
    res = RunResult(status=status, exit_codes=codes, wall_s=1.0, log_paths=logs)
    out = _no_rank_summary(tmp_path, capsys, res)
    assert f"ddp-2node (hybrid on netns): {text}" in out, out
    assert f"log node 0: {logs[0]}" in out and "node1.log" not in out  # only logs with content


def test_summary_hosts_line_leaves_out_unknown_gpu_counts(capsys, monkeypatch):
    """A script that never imports torch (a CPU-only check) gave "node 0 = vm (? GPU(s) visible)"."""
    from broker.cli import summary
    from broker.run.supervisor import RankRow

    monkeypatch.setattr(summary.console, "width", 80)
    rr = RunResult(status="succeeded", exit_codes={0: 0, 1: 0}, wall_s=1.0, log_paths={})
    rr.ranks = [RankRow(0, 0, 0, 2, host="vm"), RankRow(1, 1, 0, 2, host="vm2", gpus="1")]
    run = SimpleNamespace(id="r1", name="t", topology="local", provider="local", run_dir="/nonexistent")
    summary.render_summary(run, rr, SimpleNamespace(nodes=2))
    out = " ".join(capsys.readouterr().out.split())
    assert "node 0 = vm," in out and "node 1 = vm2 (1 GPU(s) visible)" in out and "?" not in out.split("hosts:")[1]


def test_ddp_train_says_why_it_fails_and_the_diagnosis_shows_it(tmp_path):
    """recipes/ddp_train.py --epochs 1 exited 1 without a word (its loss cannot fall in one epoch): it now prints an
    ERROR line with the first and last loss, which error_lines (the run summary's diagnosis) picks up."""
    import os
    import socket
    import subprocess
    import sys

    pytest.importorskip("torch")
    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               CUDA_VISIBLE_DEVICES="")
    cp = subprocess.run([sys.executable, str(repo / "recipes" / "ddp_train.py"), "--epochs", "1",
                         "--checkpoint", str(tmp_path / "c.pt")], env=env, capture_output=True, text=True,
                        timeout=300, cwd=tmp_path)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    log = tmp_path / "node0.log"
    log.write_text(cp.stdout + cp.stderr)
    found = [ln for ln in error_lines({0: log}) if "loss did not fall" in ln]
    assert found and "first " in found[0] and "last " in found[0] and "more epochs" in found[0], cp.stderr


@pytest.mark.parametrize("logs, cuda", [(CPU / "ok", False), (GPU / "shim_ok", True)])
def test_summary_says_cuda0_only_when_the_ranks_used_cuda(logs, cuda, capsys):
    """The summary of a gloo-on-CPU run said "each node's GPU is its cuda:0" on a run without GPUs."""
    from broker.cli import summary

    paths = {i: logs / f"node{i}.log" for i in (0, 1)}
    rr = finish_result(RunResult(status="succeeded", exit_codes={0: 0, 1: 0}, wall_s=1.0, log_paths=paths), [],
                       nnodes=2, nproc_per_node=1)
    run = SimpleNamespace(id="r1", name="t", topology="local", provider="local", run_dir=str(logs))
    summary.render_summary(run, rr, SimpleNamespace(nodes=2))
    out = " ".join(capsys.readouterr().out.split())
    assert "every LOCAL_RANK is 0" in out, out
    assert ("each node's GPU is its cuda:0" in out) is cuda, out


def test_two_ranks_on_one_gpu_is_duplicate_gpu_not_a_slow_rank():
    """1x H200 (bench/results/h200x1_dup_gpu.txt): both ranks set_device(LOCAL_RANK=0) on the one GPU; NCCL's
    "Duplicate GPU detected" is the cause, not a facts inference of a rank arriving 0.0 s late."""
    diag = diagnose_gpu_case("dup_gpu")
    assert ids(diag)[0] == "duplicate-gpu"
    assert "slow-rank" not in ids(diag)
    text = "\n".join(diag.lines())
    assert "Duplicate GPU detected" in text and "LOCAL_RANK" in text and "0.0 s" not in text


def test_slow_rank_needs_a_real_gap_and_a_timeout(tmp_path):
    """The facts-based slow-rank verdict: kept for the real 9 s late rank, dropped when the gap is a fraction of a
    second or no rank timed out."""
    assert "slow-rank" in ids(diagnose_cpu("slow_rank"))
    shutil.copytree(CPU / "slow_rank", tmp_path / "run")
    # the same 9 s lag, but the ranks raised a definite error instead of timing out: not a slow rank
    for f in (tmp_path / "run").glob("node*/facts/rank*.json"):
        facts = json.loads(f.read_text())
        facts["exception"] = {"type": "ValueError", "message": "bad batch", "frame": None}
        f.write_text(json.dumps(facts))
    for log in (tmp_path / "run").glob("node*.log"):
        log.write_text("")
    _, res = cpu_case("slow_rank")
    res.log_paths = {}
    assert "slow-rank" not in ids(explain(tmp_path / "run", res, 2))


def test_broker_shim_frames_are_never_the_users_frame():
    """1x H200 (bench/results/h200x1_no_torch.txt): the node's Python has no torch; the traceback is all broker's
    rank shim (rankshim.py _torchrun importing torch.distributed.run), which is not the user's line."""
    diag = diagnose_gpu_case("no_torch")
    assert ids(diag)[0] == "torch-missing"
    assert diag.first.frame is None, diag.first.frame
    assert "rankshim.py" not in "\n".join(diag.lines())


def test_would_have_been_caught_by_names_only_lint_rules_that_fire_on_the_script(tmp_path):
    """The catalogue's "caught by" names a lint rule; on a script where that rule finds nothing the line must not
    claim it (the rest of the line, a preflight check or the stall watch, stays)."""
    from broker.run.diagnose import Diagnosis, catalogue, lint_rules_found

    entry = next(e for e in catalogue() if e.id == "collective-timeout")
    scripts = LOGS / "scripts"
    hit = Diagnosis(lint_found=lint_rules_found(scripts / "barrier_rank0.py"))
    assert hit.caught(entry).startswith("lint rule collective-under-rank0 (a collective only rank 0 reaches); ")
    quiet = tmp_path / "train.py"
    quiet.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n")
    miss = Diagnosis(lint_found=lint_rules_found(quiet))
    assert "collective-under-rank0" not in miss.caught(entry) and miss.caught(entry).startswith("preflight tcp probes")
    assert Diagnosis().caught(entry) == entry.caught_by  # no script known: the catalogue's text


def test_would_have_been_caught_by_names_no_preflight_check_that_passed_in_this_run(tmp_path):
    """Two cases named a preflight check that had passed: a check that ran and passed here caught nothing."""
    import json

    from broker.run.diagnose import Diagnosis, _preflight_results, catalogue

    entry = next(e for e in catalogue() if e.id == "collective-timeout")
    assert "preflight tcp probes" in entry.caught_by
    (tmp_path / "preflight.json").write_text(json.dumps({"ok": True, "checks": [
        {"check": "ssh", "nodes": "0,1", "result": "PASS", "detail": ""},
        {"check": "tcp 0->1", "nodes": "0->1", "result": "PASS", "detail": ""},
        {"check": "tcp 1->0", "nodes": "1->0", "result": "PASS", "detail": ""}]}))
    passed = Diagnosis(preflight=_preflight_results(tmp_path))
    assert "preflight tcp probes" not in passed.caught(entry), passed.caught(entry)
    (tmp_path / "preflight.json").write_text(json.dumps({"ok": False, "checks": [
        {"check": "tcp 0->1", "nodes": "0->1", "result": "FAIL", "detail": ""}]}))
    failed = Diagnosis(preflight=_preflight_results(tmp_path))
    assert "preflight tcp probes" in failed.caught(entry)
    assert "preflight tcp probes" in Diagnosis().caught(entry)  # no preflight ran (this machine): it still would
    torch_entry = next(e for e in catalogue() if e.caught_by.startswith("preflight check torch"))
    (tmp_path / "preflight.json").write_text(json.dumps({"checks": [
        {"check": "torch", "nodes": "0,1", "result": "PASS", "detail": ""}]}))
    assert Diagnosis(preflight=_preflight_results(tmp_path)).caught(torch_entry).startswith("none before launch")


def test_the_hosts_line_lists_each_node_once(capsys, monkeypatch):
    """With 2 processes a node, `hosts:` listed "node 0 = vm, node 0 = vm, node 1 = ..." (a rank each)."""
    from broker.cli import summary

    d, res = cpu_case("ok")
    rr = RunResult(status=res.status, exit_codes=res.exit_codes, wall_s=1.0, log_paths=res.log_paths)
    rr = finish_result(rr, [], nnodes=2, nproc_per_node=1)
    rr.ranks = [r for r in rr.ranks for _ in (0, 1)]  # every node's rank as if it ran two processes
    monkeypatch.setattr(summary.console, "_width", 100)  # the narrow layout has the hosts line
    run = SimpleNamespace(id="r1", name="t", topology="local", provider="local", run_dir=str(d))
    summary.render_summary(run, rr, SimpleNamespace(nodes=2))
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("hosts:"))
    assert line.count("node 0 =") == 1 and line.count("node 1 =") == 1, line
