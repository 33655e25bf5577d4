"""Small CLI conventions: --version, shell completion, -v logging, LICENSE, `broker init`, `slurm render` without
side effects or local paths, every sbatch --time form."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from broker import __version__
from broker.core.errors import BadInput

REPO = Path(__file__).resolve().parents[2]


def broker(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "broker", *args], cwd=cwd or REPO, env=e, capture_output=True,
                          text=True, timeout=120)


def test_version():
    cp = broker("--version")
    assert cp.returncode == 0 and cp.stdout.strip() == f"broker {__version__}"


def test_shell_completion_is_on():
    cp = broker("--help")
    assert cp.returncode == 0 and "--install-completion" in cp.stdout and "--show-completion" in cp.stdout
    # the completion protocol itself answers (what the installed shell hook calls)
    cp = broker(env={"_BROKER_COMPLETE": "complete_bash", "COMP_WORDS": "broker pl", "COMP_CWORD": "1"})
    assert cp.returncode == 0 and "plan" in cp.stdout, cp.stdout + cp.stderr


def test_verbose_sends_logging_to_stderr(tmp_path):
    code = ("import logging, sys; from broker.cli import app as cli\n"
            "@cli.app.command('log-test')\n"
            "def _l():\n    logging.getLogger('broker.x').info('hello-info'); "
            "logging.getLogger('broker.x').debug('hello-debug')\n"
            "cli.main(sys.argv[1:])\n")
    e = dict(os.environ, PYTHONPATH=str(REPO), BROKER_HOME=str(tmp_path))

    def run(*a):
        return subprocess.run([sys.executable, "-c", code, *a], env=e, capture_output=True, text=True, timeout=60)

    quiet, v, vv = run("log-test"), run("-v", "log-test"), run("--verbose", "-v", "log-test")
    assert quiet.returncode == v.returncode == vv.returncode == 0, quiet.stderr + v.stderr
    assert "hello-info" not in quiet.stderr
    assert "hello-info" in v.stderr and "hello-debug" not in v.stderr and "hello-info" not in v.stdout
    assert "hello-debug" in vv.stderr


def test_license_is_apache_2():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert 'license = "Apache-2.0"' in (REPO / "pyproject.toml").read_text()


# ------------------------------------------------------------------------------------------------ broker init
def test_init_writes_the_examples_and_they_load(tmp_path):
    d = tmp_path / "ex"
    cp = broker("init", str(d))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "ddp_2node.yaml" in cp.stdout and "broker run" in cp.stdout
    for f in ("ddp_2node.yaml", "ddp_train.py", "allreduce_bench.yaml", "allreduce_bench.py", "data/digits.csv.gz"):
        assert (d / f).read_bytes() == (REPO / "recipes" / f).read_bytes(), f
    assert not list(d.rglob("__pycache__"))
    from broker.core.recipe import load_recipe

    r = load_recipe(d / "ddp_2node.yaml")
    assert r.script == (d / "ddp_train.py").resolve()
    # no silent overwrite
    cp = broker("init", str(d))
    assert cp.returncode == 2 and "--force" in cp.stderr
    assert broker("init", str(d), "--force").returncode == 0


def test_examples_are_package_data():
    """The examples are in the package (broker.recipes), so `pip install` ships them: they come from there, not
    from the checkout's recipes/ folder."""
    from broker.cli.init import example_files

    files = example_files()
    assert {"ddp_2node.yaml", "ddp_train.py", "allreduce_bench.yaml", "data/digits.csv.gz"} <= set(files)
    py = (REPO / "pyproject.toml").read_text()
    assert '"broker.recipes" = "recipes"' in py and '"broker.recipes" = ["*.yaml", "*.py"]' in py
    assert '"broker.recipes.data" = ["*.gz", "*.md"]' in py  # the wheel's content: tests/cli/test_install.py
    assert "__init__.py" not in files


def test_init_into_a_file_is_bad_input(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    cp = broker("init", str(f))
    assert cp.returncode == 2 and "not a folder" in cp.stderr


# ------------------------------------------------------------------------------------------------ slurm render
@pytest.fixture()
def recipe_path(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"name: ddp-fast\nscript: {REPO}/recipes/ddp_train.py\nworkdir: {REPO}/recipes\nnodes: 2\n"
                 "cpu_ok: true\nmax_hours: 0.25\n")
    return p


def test_render_has_no_side_effects_and_no_local_paths(recipe_path, tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    cp = broker("slurm", "render", str(recipe_path), cwd=work)
    assert cp.returncode == 0, cp.stderr
    assert list(work.iterdir()) == []  # no ./slurm-logs (or anything) created
    s = cp.stdout
    assert str(tmp_path) not in s and str(REPO) not in s and "/work/" not in s
    assert "#SBATCH --output=slurm-logs/%x-%j-batch.out" in s and "#SBATCH --chdir=." in s
    # where logs go, and that the folder must exist before sbatch: in the printed submit line
    assert "slurm-logs/" in cp.stderr and "must exist" in cp.stderr and "mkdir -p slurm-logs && sbatch" in cp.stderr


def test_render_output_file_only(recipe_path, tmp_path):
    out = tmp_path / "o" / "job.sbatch"
    out.parent.mkdir()
    cp = broker("slurm", "render", str(recipe_path), "-o", str(out), cwd=tmp_path)
    assert cp.returncode == 0, cp.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["job.sbatch"]
    assert not (tmp_path / "slurm-logs").exists()
    assert f"mkdir -p slurm-logs && sbatch {out}" in cp.stderr


def test_render_paths_only_when_asked(recipe_path, tmp_path):
    cp = broker("slurm", "render", str(recipe_path), "--workdir", "/scratch/me/job", "--log-dir", "/scratch/me/logs")
    assert cp.returncode == 0, cp.stderr
    assert "#SBATCH --chdir=/scratch/me/job" in cp.stdout and "LOG_DIR=/scratch/me/logs" in cp.stdout
    assert not Path("/scratch/me/logs").exists()


@pytest.mark.parametrize("value, seconds", [
    ("30", 1800), ("90", 5400), ("30:15", 1815), ("90:00", 5400), ("01:02:03", 3723), ("100:00:00", 360000),
    ("2-12", 216000), ("1-00:30", 88200), ("1-02:03:04", 93784), ("0-0:1", 60),
])
def test_every_sbatch_time_form(value, seconds):
    from broker.slurm.executor import check_time, time_seconds

    assert time_seconds(value) == seconds
    assert check_time(value) == value


@pytest.mark.parametrize("value", ["5m", "1:2:3:4", "1-25", "1-02:60", "01:60:00", "00:00:60", "-1", "", "1d",
                                   "0", "00:00:00", "UNLIMITED"])
def test_bad_sbatch_times(value):
    from broker.slurm.executor import check_time

    with pytest.raises(BadInput):
        check_time(value)


def test_render_accepts_day_forms_via_cli(recipe_path):
    cp = broker("slurm", "render", str(recipe_path), "--time", "1-12")
    assert cp.returncode == 0 and "#SBATCH --time=1-12" in cp.stdout, cp.stderr
    cp = broker("slurm", "render", str(recipe_path), "--time", "5m")
    assert cp.returncode == 2 and "HH:MM:SS" in cp.stderr and "D-HH" in cp.stderr


def test_render_keeps_env_references_and_prints_no_secret(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"name: j\nscript: {REPO}/recipes/ddp_train.py\nworkdir: {REPO}/recipes\ncpu_ok: true\n"
                 "env: {HF_TOKEN: '${MY_TOKEN}', MIX: 'a \"b\" $c ${MY_TOKEN}', PLAIN: x}\n")
    cp = broker("slurm", "render", str(p), env={"MY_TOKEN": "s3cr3t-value"})
    assert cp.returncode == 0, cp.stderr
    assert "s3cr3t" not in cp.stdout + cp.stderr
    assert 'export HF_TOKEN="${MY_TOKEN}"' in cp.stdout.splitlines()
    assert "MY_TOKEN" in cp.stderr
    # bash expands only the reference: the rest stays literal
    exports = "\n".join(ln for ln in cp.stdout.splitlines() if ln.startswith("export "))
    out = subprocess.run(["bash", "-c", exports + '\nprintf "%s|%s|%s" "$HF_TOKEN" "$MIX" "$PLAIN"'],
                         env={"MY_TOKEN": "tok", "PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert out.stdout == 'tok|a "b" $c tok|x', out.stdout + out.stderr
    # unset at render time is fine (resolved where the job runs)
    cp = broker("slurm", "render", str(p), env={"MY_TOKEN": ""})
    assert cp.returncode == 0


# ------------------------------------------------------------------------------------------------ --help at 80 columns
def _groups() -> dict[tuple[str, ...], list[str]]:
    """{command path of each group: its subcommand names}, from the CLI itself (a new command is covered too)."""
    from broker.cli import app as cli
    out: dict[tuple[str, ...], list[str]] = {}

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            out[path] = list(subs)
            for name, sub in subs.items():
                walk(sub, path + (name,))

    walk(typer.main.get_command(cli.app), ())
    return out


def _leaves() -> list[tuple[str, ...]]:
    from broker.cli import app as cli
    out: list[tuple[str, ...]] = []

    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if not subs:
            out.append(path)
        for name, sub in (subs or {}).items():
            walk(sub, path + (name,))

    walk(typer.main.get_command(cli.app), ())
    return out


@pytest.mark.parametrize("group", sorted(_groups()))
def test_every_short_help_is_whole_at_80_columns(group):
    cp = broker(*group, "--help", env={"COLUMNS": "80"})
    assert cp.returncode == 0, cp.stderr
    cut = [ln for ln in cp.stdout.splitlines()[1:] if ln.rstrip().endswith(("...", "…"))]  # [0]: "[ARGS]..."
    assert cp.stdout.startswith("Usage: broker")
    assert not cut, cut
    listed = cp.stdout.split("Commands:", 1)[1]
    rows = {ln.split()[0]: ln for ln in listed.splitlines() if ln.startswith("  ") and not ln.startswith("   ")}
    for name in _groups()[group]:  # every command on one line of its own, with its description
        assert name in rows and len(rows[name].split()) >= 3, (name, listed)


def test_usage_lines_name_arguments_plainly(capsys):
    """`broker run [OPTIONS] RECIPE`, not `{RECIPE}` (newer Typer's braces) nor a lower-case parameter name."""
    import re

    from broker.cli import app as cli
    cp = broker("run", "--help")
    assert cp.stdout.splitlines()[0] == "Usage: broker run [OPTIONS] RECIPE|SCRIPT.py [-- SCRIPT ARGS]", cp.stdout
    cp = broker("run")  # the usage line of a usage error too
    assert cp.returncode == 2 and "usage: broker run [OPTIONS] RECIPE|SCRIPT.py [-- SCRIPT ARGS]" in cp.stderr, \
        cp.stderr
    for path in _leaves():  # every command's --help, through the same entry point
        with pytest.raises(SystemExit) as ex:
            cli.main([*path, "--help"])
        assert ex.value.code == 0
        usage = capsys.readouterr().out.splitlines()[0]
        assert usage.startswith(f"Usage: broker {' '.join(path)} [OPTIONS]"), usage
        args = usage.split("[OPTIONS]", 1)[1]
        assert not re.search(r"[{}<>]", args), usage
        words = re.sub(r"\.py\b", "", args)  # SCRIPT.py: a file's suffix is written as typed
        assert words == words.upper(), usage  # RUN, [NODES], [PROVIDER]...: not run_id, nodes, provider


# ------------------------------------------------------------------------------------------------ -v / -vv
@pytest.mark.parametrize("args, info, debug", [
    (["plan", "--budget", "5"], ["INFO broker.plan.facts: asking providers local, vast, oci, aws",
                                 "INFO broker.plan.facts: vast: asking for offers (price snapshot: not configured)",
                                 "INFO broker.plan.facts: vast: 27 offer(s) from the price snapshot"],
     ["DEBUG broker.plan.facts: chosen: simulated on vast", "DEBUG broker.plan.facts: rejected: "]),
    (["offers"], ["INFO broker.plan.facts: asking providers vast, oci, aws"], []),
])
def test_verbose_logs_what_broker_does_and_stdout_does_not_change(tmp_path, args, info, debug):
    env = {"BROKER_HOME": str(tmp_path), "COLUMNS": "80"}
    quiet, v, vv = broker(*args, env=env), broker("-v", *args, env=env), broker("-vv", *args, env=env)
    assert quiet.returncode == v.returncode == vv.returncode == 0, vv.stderr
    assert quiet.stderr == "" and v.stdout == quiet.stdout and vv.stdout == quiet.stdout
    for line in info:
        assert line in v.stderr and line in vv.stderr, v.stderr
    for line in debug:
        assert line not in v.stderr and line in vv.stderr, vv.stderr
    assert "DEBUG" not in v.stderr


def test_verbose_leaves_other_libraries_quiet_and_scrubs_secrets(tmp_path):
    """Only broker's own loggers speak at -vv (httpx/botocore debug output carries request headers), and a secret
    value from the environment is scrubbed from any record."""
    code = ("import logging, sys; from broker.cli import app as cli\n"
            "@cli.app.command('log-test')\n"
            "def _l():\n"
            "    logging.getLogger('httpx').info('GET https://x/ Authorization: Bearer lib-secret')\n"
            "    logging.getLogger('broker.x').debug('key is %s', 'sentinel-secret-value-123')\n"
            "cli.main(sys.argv[1:])\n")
    e = dict(os.environ, PYTHONPATH=str(REPO), BROKER_HOME=str(tmp_path), VAST_API_KEY="sentinel-secret-value-123")
    cp = subprocess.run([sys.executable, "-c", code, "-vv", "log-test"], env=e, capture_output=True, text=True,
                        timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert "lib-secret" not in cp.stderr and "sentinel-secret-value-123" not in cp.stderr
    assert "DEBUG broker.x: key is ***" in cp.stderr


def test_verbose_check_and_status(tmp_path):
    env = {"BROKER_HOME": str(tmp_path)}
    cp = broker("-v", "status", env=env)
    assert cp.returncode == 0 and "INFO broker.cli.status: status: ledger " in cp.stderr, cp.stderr
    assert "0 live instance(s) to refresh" in cp.stderr
    cp = broker("-vv", "check", env=env)
    assert cp.returncode == 0 and "INFO broker.cli.plan: check vast: credentials missing" in cp.stderr, \
        cp.stderr


# ------------------------------------------------------------------------------------------------ --json
#: one cheap invocation per command that has --json (an error is JSON too, so some are expected to fail)
JSON_CALLS = {
    ("catalog", "show"): ["catalog", "show"],
    ("check",): ["check"],
    ("cost",): ["cost"],
    ("down",): ["down", "no-such-run"],
    ("exec",): ["exec", "no-such-run", "recipes/ddp_2node.yaml"],
    ("lint",): ["lint", "recipes/ddp_train.py"],
    ("netns", "up"): ["netns", "up", "--nodes", "0"],
    ("offers",): ["offers", "--limit", "1"],
    ("plan",): ["plan", "--budget", "5"],
    ("quota", "check"): ["quota", "check", "-p", "oci"],
    ("quota", "request"): ["quota", "request", "-p", "nope"],
    ("quota", "status"): ["quota", "status", "--no-refresh"],
    ("reconcile",): ["reconcile"],
    ("run",): ["run", "no-such.yaml"],
    ("slurm", "down"): ["slurm", "down", "nope"],
    ("slurm", "status"): ["slurm", "status", "nope"],
    ("slurm", "submit"): ["slurm", "submit", "nope.sh", "--cluster", "nope"],
    ("slurm", "up"): ["slurm", "up", "--provider", "nope"],
    ("start",): ["start", "no-such-run"],
    ("status",): ["status"],
    ("stop",): ["stop", "no-such-run"],
    ("watchdog",): ["watchdog", "--once"],
}


def test_every_json_command_is_listed_here():
    from broker.cli.app import command

    have = {p for p, c in _walk(command()) if "--json" in {o for prm in c.params for o in prm.opts}}
    assert have == set(JSON_CALLS), have ^ set(JSON_CALLS)


def _walk(cmd, path=()):
    yield path, cmd
    for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
        yield from _walk(sub, path + (name,))


@pytest.mark.parametrize("path", sorted(JSON_CALLS))
def test_every_json_output_has_schema_version(tmp_path, path):
    cp = broker(*JSON_CALLS[path], "--json", env={"BROKER_HOME": str(tmp_path)})
    doc = json.loads(cp.stdout)
    assert isinstance(doc, dict) and doc["schema_version"] == 1, cp.stdout
    assert list(doc)[0] == "schema_version"
    if cp.returncode != 0 and "error" in doc:
        assert cp.stderr.startswith("error: "), cp.stderr  # the message on stderr as well


def test_aws_debug_params_hide_boot_scripts_and_keys():
    """`-vv` logs an AWS call's parameters; a boot script (which can carry a WireGuard key or TS_AUTHKEY) and any
    key/secret/token value are replaced by their length, at any depth; tag keys and key pair names stay."""
    from broker.providers.aws.api import loggable_params

    text = loggable_params({"InstanceType": "g5.xlarge", "UserData": "IyEvYmluL2Jhc2gKVFNfQVVUSEtFWT10c2tleS0xMjM=",
                            "KeyName": "broker-r1", "TagSpecifications": [{"Tags": [{"Key": "broker-run",
                                                                                   "Value": "r1"}]}],
                            "LaunchTemplateData": {"UserData": "c2VjcmV0", "SessionToken": "tok-abcdef"}})
    assert "IyEvYmluL2Jhc2g" not in text and "c2VjcmV0" not in text and "tok-abcdef" not in text
    assert '"UserData": "<44 chars>"' in text and '"KeyName": "broker-r1"' in text
    assert '"Key": "broker-run"' in text and '"InstanceType": "g5.xlarge"' in text


def test_debug_logs_the_commands_run_on_nodes(tmp_path, caplog):
    """`-vv` logs every command broker runs on a node and its exit status (node 0 of a hybrid run is this machine:
    the same SSHCluster calls, no SSH needed for the test)."""
    import logging

    from broker.core.records import Cluster, ClusterNode
    from broker.run.sshcluster import SSHCluster

    node = ClusterNode(node_rank=0, host="localhost", port=0, private_ip="127.0.0.1", local=True,
                       workroot=str(tmp_path / "here"))
    ssh = SSHCluster(Cluster(run_id="r1", provider="oci", topology="hybrid", nodes=[node]), run_dir=tmp_path / "run")
    try:
        ssh.open()
        with caplog.at_level(logging.DEBUG, logger="broker"):
            assert ssh.run(0, "echo hi; exit 3") == (3, "hi\n")
    finally:
        ssh.close()
    msgs = [r.getMessage() for r in caplog.records if r.name == "broker.run.sshcluster"]
    assert "ssh node 0: echo hi; exit 3" in msgs and "ssh node 0: exit 3" in msgs, msgs


def test_verbose_main_in_process_leaves_no_logging_state(capsys):
    """An in-process `cli.main(['-vv', ...])` left its handler on a stream that was later closed: every later
    command in that process printed "--- Logging error ---" into its output (seen as JSON that would not parse)."""
    import json
    import logging

    from typer.testing import CliRunner

    from broker.cli import app as cli
    before = (list(logging.getLogger().handlers), logging.getLogger("broker").level)
    try:
        cli.main(["-vv", "plan", "--budget", "5", "--offline"])
    except SystemExit:
        pass
    assert "INFO broker" in capsys.readouterr().err
    assert (list(logging.getLogger().handlers), logging.getLogger("broker").level) == before
    assert not logging.getLogger("broker").handlers
    r = CliRunner().invoke(cli.app, ["plan", "--budget", "5", "--offline", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["schema_version"] >= 1
