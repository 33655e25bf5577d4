"""Trust boundaries, second round: what a node writes into its rank facts, what a folder's ``.env`` sets, what a
job prints of its secrets, which files staging ships and the modes of a run folder's files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from broker.run.supervisor import RunResult, rank_table

HOSTILE = "\x1b]0;TITLE\x07\x1b[2J\x9b2J\x1b]8;;http://evil.example/\x1b\\link\x1b]8;;\x1b\\[/dim][bold]BOLD\u202eevil"


def _hostile_facts(tmp_path: Path) -> dict[int, Path]:
    facts = tmp_path / "node0" / "facts"
    facts.mkdir(parents=True)
    (facts / "rank0.json").write_text(json.dumps({
        "rank": 0, "local_rank": 0, "world_size": 1, "host": "h" + HOSTILE, "python": "3" + HOSTILE,
        "device": "cpu" + HOSTILE, "backend": "gloo" + HOSTILE, "torch": "2" + HOSTILE, "gpus_visible": "0",
        "cuda_visible_devices": HOSTILE + "x" * 5000}))
    log = tmp_path / "node0.log"
    log.write_text("")
    return {0: log}


@pytest.mark.parametrize("width", [80, 200])
def test_node_facts_reach_the_summary_without_controls_or_markup(tmp_path, capsys, monkeypatch, width):
    from broker.core import ui
    from broker.cli import summary

    logs = _hostile_facts(tmp_path)
    rows = rank_table(logs, nnodes=1, nproc_per_node=1)
    assert all(len(getattr(rows[0], k)) <= 256 for k in ("host", "cuda_visible_devices"))
    rr = RunResult(status="succeeded", exit_codes={0: 0}, wall_s=1.0, log_paths=logs, ranks=rows)
    monkeypatch.setattr(ui.console, "width", width)
    run = SimpleNamespace(id="r1", name="t", topology="local", provider="local", run_dir=str(tmp_path))
    summary.render_summary(run, rr, SimpleNamespace(nodes=1))
    out = capsys.readouterr().out
    for bad in ("\x1b", "\x07", "\x9b", "\u202e"):
        assert bad not in out
    assert "[/dim][bold]BOLD" in out  # shown as text, not obeyed
    assert "every rank: Python 3" in out
    if width < 110:
        assert "hosts: node 0 = h" in out
    assert "x" * 100 not in out  # each value bounded


def test_bidi_controls_are_removed_and_shown_with_v():
    from broker.core import ui
    assert ui.strip_controls("a\u202eb\u2066c\u2069d\u202a—’\n") == "abcd—’\n"
    assert ui.strip_controls("\x1b[31m\u202dx\x9b2J") == "x"
    assert ui.visible_controls("a\u202eb") == "a\\u202eb"
    # the fast path and the one regex agree on text with bidi controls too
    import random

    alphabet = list("ab \t\n\r\x1b[]0;2Km\x07\\\x9c\x9b") + ["\u202e", "\u2066", "\u2014", "\u2069", "\u00e9"]
    rng = random.Random(3)
    for _ in range(5000):
        t = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        want = ui._CONTROLS.sub("", ui._OVERWRITTEN.sub("", t) if "\r" in t else t)
        assert ui.strip_controls(t) == want, repr(t)


# ------------------------------------------------------------------------------------------- .env: where, not keys
def _dotenv(folder: Path, monkeypatch, text: str, *clear: str):
    from broker.core import config
    monkeypatch.chdir(folder)
    for v in clear:
        monkeypatch.delenv(v, raising=False)
    (folder / ".env").write_text(text)
    config.settings.cache_clear()
    config._NOTICED.clear()
    return config


@pytest.mark.parametrize("var,value", [("OCI_REGION", "attacker.example"), ("AWS_DEFAULT_REGION", "evil.example/x"),
                                       ("AWS_REGION", "us-east-1.attacker.example"), ("OCI_REGION", "us-ashburn-1@x")])
def test_a_region_that_is_not_the_provider_s_form_is_refused(var, value, tmp_path, monkeypatch):
    from broker.core.errors import BadInput

    config = _dotenv(tmp_path, monkeypatch, f"{var}={value}\n", "OCI_REGION", "AWS_DEFAULT_REGION", "AWS_REGION")
    try:
        with pytest.raises(BadInput) as e:
            config.settings()
        assert var in str(e.value) and "region" in str(e.value) and e.value.hint
    finally:
        config.settings.cache_clear()


def test_a_valid_region_from_dotenv_is_used(tmp_path, monkeypatch):
    config = _dotenv(tmp_path, monkeypatch, "OCI_REGION=eu-frankfurt-1\nAWS_DEFAULT_REGION=us-gov-west-1\n",
                     "OCI_REGION", "AWS_DEFAULT_REGION", "AWS_REGION")
    try:
        s = config.settings()
        assert s.oci_region == "eu-frankfurt-1" and s.aws_region == "us-gov-west-1"
    finally:
        config.settings.cache_clear()


def test_oci_sdk_never_builds_an_endpoint_from_a_dotenv_region(tmp_path, monkeypatch, cli_env):
    """The exact case: ``OCI_REGION=attacker.example`` in ``.env`` made the OCI SDK call
    ``https://iaas.attacker.example/...``.  Now no OCI client is built: the adapter refuses, naming the variable
    and the form (``broker offers`` then shows the snapshot prices with that note)."""
    import subprocess

    from tests.conftest import broker_cmd

    (tmp_path / ".env").write_text("OCI_REGION=attacker.example\n")
    env = dict(cli_env)
    for v in ("OCI_REGION", "OCI_SERVICE_ENDPOINT"):
        env.pop(v, None)
    p = subprocess.run(broker_cmd("offers", "--provider", "oci"), cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    out = " ".join((p.stdout + p.stderr).split())
    assert "OCI_REGION='attacker.example' is not a oci region name" in out and "us-ashburn-1" in out, out
    assert "iaas.attacker.example" not in out


def test_an_explicit_region_is_validated_by_the_sdk_wrappers():
    from broker.core.errors import BadInput
    from broker.providers.aws.api import AWSApi
    from broker.providers.oci.sdk import OCIApi

    with pytest.raises(BadInput):
        OCIApi(config={}, region="attacker.example")
    with pytest.raises(BadInput):
        AWSApi(region="attacker.example")
    assert OCIApi(config={}, region="us-ashburn-1")._region == "us-ashburn-1"


@pytest.mark.parametrize("var,value", [("BROKER_SLURM_HOST", "attacker@127.0.0.1"), ("OCI_PROFILE", "OTHER"),
                                       ("AWS_PROFILE", "prod"), ("OCI_CONFIG_FILE", "/tmp/evil-oci-config")])
def test_hosts_and_credential_pointers_in_dotenv_are_ignored_with_one_line(var, value, tmp_path, monkeypatch,
                                                                           capsys):
    config = _dotenv(tmp_path, monkeypatch, f"{var}={value}\nVAST_API_KEY=k\n", var)
    try:
        s = config.settings()
        assert getattr(s, var.lower()) == getattr(config.EnvSettings(), var.lower())
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.startswith("broker: ignoring")]
        assert len(lines) == 1 and var in lines[0] and "real environment" in lines[0]
    finally:
        config.settings.cache_clear()


def test_slurm_host_from_the_environment_still_works(tmp_path, monkeypatch):
    config = _dotenv(tmp_path, monkeypatch, "VAST_API_KEY=k\n")
    monkeypatch.setenv("BROKER_SLURM_HOST", "me@login.example")
    try:
        assert config.settings().broker_slurm_host == "me@login.example"
    finally:
        config.settings.cache_clear()


def test_a_dotenv_vast_key_that_overrides_the_key_file_says_so(tmp_path, monkeypatch, capsys):
    from broker.providers.vast import client

    home = tmp_path / "home"
    (home / ".config" / "vastai").mkdir(parents=True)
    (home / ".config" / "vastai" / "vast_api_key").write_text("users-own-key\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    folder = tmp_path / "cloned"
    folder.mkdir()
    config = _dotenv(folder, monkeypatch, "VAST_API_KEY=someone-elses-key\n", "VAST_API_KEY")
    client._OVERRIDE_NOTICED.clear()
    try:
        key, where = client.find_api_key()
        assert key == "someone-elses-key" and where == "VAST_API_KEY (.env)"
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "overrides the key in" in err and "vast_api_key" in err
        assert "someone-elses-key" not in err and "users-own-key" not in err
    finally:
        config.settings.cache_clear()


# ------------------------------------------------------------------------------------------------------- secrets
def _recipe(tmp_path: Path, env_yaml: str, extra: str = "") -> Path:
    (tmp_path / "t.py").write_text("print('hi')\n")
    r = tmp_path / "r.yaml"
    r.write_text(f"name: s\nscript: t.py\nnodes: 1\ncpu_ok: true\nmax_hours: 0.1\n{extra}env:\n{env_yaml}")
    return r


@pytest.mark.parametrize("name", ["VAST_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "TS_AUTHKEY",
                                  "OCI_PRIVATE_KEY_PASSPHRASE_TOKEN"])
def test_env_that_copies_broker_s_own_credential_is_refused(name, tmp_path, monkeypatch):
    from broker.core.errors import BadInput
    from broker.core.recipe import load_recipe

    monkeypatch.setenv(name, "value-of-the-users-credential")
    r = _recipe(tmp_path, f"  JOB_KEY: ${{{name}}}\n")
    for resolve in (True, False):
        with pytest.raises(BadInput) as e:
            load_recipe(r, resolve=resolve)
        msg = str(e.value) + " " + (e.value.hint or "")
        assert name in msg and "secrets:" in msg and "value-of-the-users-credential" not in msg


def test_env_referencing_other_variables_still_resolves(tmp_path, monkeypatch):
    from broker.core.recipe import load_recipe

    monkeypatch.setenv("MY_DATASET", "/data/x")
    rec = load_recipe(_recipe(tmp_path, "  DATA: ${MY_DATASET}\n"))
    assert rec.env["DATA"] == "/data/x"


def test_url_credentials_in_env_are_masked_where_stored(tmp_path, monkeypatch):
    from broker.core.private import known_secrets
    from broker.core.recipe import load_recipe

    monkeypatch.setenv("DB_PASS", "hunter2-db-pass")
    rec = load_recipe(_recipe(tmp_path, "  DB: postgres://alice:s3cr3t-pw@db.example:5432/x\n"
                                        "  MIRROR: https://pypi.example/simple\n"))
    dumped = json.dumps(rec.model_dump(mode="json"))
    assert "s3cr3t-pw" not in dumped and "postgres://alice:********@db.example:5432/x" in dumped
    assert "https://pypi.example/simple" in dumped  # a URL without a password is kept
    assert rec.env["DB"] == "postgres://alice:s3cr3t-pw@db.example:5432/x"  # the node still gets it
    assert "s3cr3t-pw" in known_secrets()  # and log lines are scrubbed of it
    assert any("URL with a password" in w for w in rec._load_warnings)


def test_stream_scrubber_masks_a_value_split_anywhere():
    from broker.core.private import MASK, StreamScrubber

    secret = "tok-0123456789abcdef"
    text = f"a {secret} b {secret}{secret} tok-01 end\n".encode()
    for cut1 in range(len(text)):
        for cut2 in (cut1 + 1, cut1 + 7, len(text)):
            sc = StreamScrubber([secret, "other-secret-value"])
            out = sc.feed(text[:cut1]) + sc.feed(text[cut1:cut2]) + sc.feed(text[cut2:]) + sc.flush()
            assert out == text.replace(secret.encode(), MASK.encode()), (cut1, cut2)
    assert not StreamScrubber([])


SPLIT_PRINT = ("import os, sys, time\n"
               "v = os.environ['JOB_SECRET']\n"
               "sys.stdout.write('secret is ' + v[:5]); sys.stdout.flush(); time.sleep(0.3)\n"
               "sys.stdout.write(v[5:] + ' and again ' + v + '\\n'); sys.stdout.flush()\n")


def test_a_secret_the_job_prints_is_masked_on_the_terminal_and_in_the_node_log(tmp_path, capsys):
    import os
    import sys

    from broker.run.supervisor import LocalNode, Supervisor
    from broker.core.private import register_secret
    from broker.core.ui import echo_line

    secret = "s3cr3t-printed-by-the-job-42"
    register_secret(secret)
    log = tmp_path / "node0.log"
    node = LocalNode(0, [sys.executable, "-c", SPLIT_PRINT], dict(os.environ, JOB_SECRET=secret), tmp_path)
    res = Supervisor({0: log}, echo=echo_line, grace_s=1.0).run([node], deadline_s=60)
    assert res.status == "succeeded"
    out = capsys.readouterr().out
    raw = log.read_bytes()
    assert secret not in out and secret.encode() not in raw
    assert secret[:5].encode() not in raw  # the half in the first block was held back, then masked whole
    assert "[node 0] secret is ******** and again ********" in out
    assert b"secret is ******** and again ********\n" in raw


# ------------------------------------------------------------------------------------------------------- staging
def test_credential_files_in_any_case_and_more_kinds_are_not_staged(tmp_path):
    from broker.run.executor import staging_line
    from broker.run.staging import stage_plan

    w = tmp_path / "w"
    w.mkdir()
    names = ["ID_RSA", "KEY.PEM", "Credentials.json", "credentials", "application_default_credentials.json",
             "client_secret_123.apps.json", "service-account-prod.json", ".pypirc", ".npmrc", "kubeconfig",
             ".vault-token", "secrets.yaml", "secrets.yml", "Token.JSON", "WG0.conf"]
    for n in names + ["train.py", "ID_utils.py", "config.json", "secrets_test.py"]:
        (w / n).write_text("x")
    for d in (".docker", ".kube", ".SSH"):
        (w / d).mkdir()
        (w / d / "config" if d != ".docker" else w / d / "config.json").write_text("token")
    plan = stage_plan(w)
    assert sorted(str(f) for f in plan.files) == ["ID_utils.py", "config.json", "secrets_test.py", "train.py"]
    run = tmp_path / "run"
    run.mkdir()
    staging_line(plan, run)
    skipped = (run / "staged.txt").read_text().split("# not copied", 1)[1]
    assert all(n in skipped for n in names + [".docker", ".kube", ".SSH"]), skipped


# ------------------------------------------------------------------------------------------------- file modes
def test_every_file_of_a_finished_local_run_is_private_under_umask_022(cli_env, tmp_path):
    """node0.log, staged.txt, artifacts/, node0/ (its work copy, torchrun's logs, the rank facts) were created
    0644 / 0755 under umask 022; now every file is 0600 (an executable the user staged keeps its owner x bit) and
    every folder 0700."""
    import os
    import stat
    import subprocess

    from tests.conftest import REPO, broker_cmd

    d = tmp_path / "job"
    d.mkdir()
    (d / "t.py").write_text("open('out.txt', 'w').write('x')\nprint('hi')\n")
    (d / "tool.sh").write_text("#!/bin/sh\n")
    os.chmod(d / "tool.sh", 0o755)
    (d / "r.yaml").write_text("name: modes\nscript: t.py\nnodes: 2\ncpu_ok: true\nmax_hours: 0.1\n"
                              "setup: ['echo set up']\nartifacts: [out.txt]\n")
    p = subprocess.run(broker_cmd("run", str(d / "r.yaml"), "--provider", "local"), cwd=REPO, env=cli_env,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, umask=0o022)
    assert p.returncode == 0, p.stdout + p.stderr
    runs = Path(cli_env["BROKER_HOME"]) / "runs"
    (run,) = list(runs.iterdir())
    wide = []
    seen = set()
    for dirpath, dirnames, filenames in os.walk(run):
        for name in dirnames:
            m = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
            if m != 0o700:
                wide.append((oct(m), os.path.relpath(os.path.join(dirpath, name), run)))
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, run)
            seen.add(rel)
            m = stat.S_IMODE(os.lstat(full).st_mode)
            if m != (0o700 if name == "tool.sh" else 0o600):
                wide.append((oct(m), rel))
    assert not wide, wide
    assert {"node0.log", "node1.log", "staged.txt", "recipe.json", "artifacts/node0/out.txt",
            "node0/work/t.py", "node0/facts/rank0.json"} <= seen, sorted(seen)


# ------------------------------------------------------------------------------------------------- recipe.json
def test_recipe_json_records_gpus_per_node_as_written(tmp_path, cli_env):
    """recipe.json said ``gpus_per_node: 1`` for a recipe that said 0: the CPU-only validator sets 1 for the
    launchers (one process per node); the stored recipe is what the user wrote, and reads back as the same job."""
    import subprocess

    from broker.core.recipe import Recipe, load_recipe
    from tests.conftest import REPO, broker_cmd

    d = tmp_path / "job"
    d.mkdir()
    (d / "t.py").write_text("print('hi')\n")
    (d / "r.yaml").write_text("name: cpu\nscript: t.py\nnodes: 1\ngpus_per_node: 0\ncpu_ok: true\nmax_hours: 0.1\n")
    rec = load_recipe(d / "r.yaml")
    assert rec.cpu_only and rec.gpus_per_node == 1  # what the launchers use
    dumped = rec.model_dump(mode="json")
    assert dumped["gpus_per_node"] == 0
    again = Recipe.model_validate({k: v for k, v in dumped.items() if k not in ("script", "workdir")} |
                                  {"script": "t.py"})
    assert again.cpu_only and again.requirements().gpus_per_node == 0
    p = subprocess.run(broker_cmd("run", str(d / "r.yaml"), "--provider", "local"), cwd=REPO, env=cli_env,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr
    (run,) = list((Path(cli_env["BROKER_HOME"]) / "runs").iterdir())
    assert json.loads((run / "recipe.json").read_text())["gpus_per_node"] == 0
    # a GPU recipe is unchanged
    (d / "g.yaml").write_text("name: g\nscript: t.py\nnodes: 1\ngpus_per_node: 4\nmax_hours: 0.1\n")
    assert load_recipe(d / "g.yaml").model_dump(mode="json")["gpus_per_node"] == 4


def test_the_stream_scrubber_masks_text_blocks_too():
    """An SSH node's output reaches the pump decoded (str): the scrubber compared bytes with it and raised
    TypeError in the pump thread, which then stopped streaming that node's output."""
    from broker.core.private import MASK, StreamScrubber

    s = StreamScrubber(["sekret-value-9"])
    out = s.feed("token sekret-va") + s.feed("lue-9 done\n") + s.flush()
    assert out == f"token {MASK} done\n" and isinstance(out, str)
    b = StreamScrubber(["sekret-value-9"])
    outb = b.feed(b"x sekret-value") + b.feed(b"-9\n") + b.flush()
    assert outb == f"x {MASK}\n".encode()
