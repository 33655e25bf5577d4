"""The CLI's one error boundary (broker.cli.app.main): every failure is one message with what to do and the documented
exit code (0 ok, 1 job failed, 2 bad input, 3 no valid plan, 4 provider error, 130 interrupted); never a Python
traceback.  Run through `python -m broker` in a subprocess, exactly as a user meets it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def broker(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120):
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "broker", *args], cwd=cwd or REPO, env=e, capture_output=True,
                          text=True, timeout=timeout)


def unwrapped(text: str) -> str:
    """``text`` with the line breaks and hanging indents of wrapped prose made single spaces (messages wrap at the
    terminal's width, 80 in a pipe; a path or command is never broken, so needles are found whole)."""
    return " ".join(text.split())


def one_message(cp: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    out = cp.stdout + cp.stderr
    assert cp.returncode == code, out
    assert "Traceback" not in out, out
    assert "error:" in cp.stderr, out
    flat = unwrapped(out)
    for n in needles:
        assert n in out or unwrapped(n) in flat, out
    return out


@pytest.fixture()
def job(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")

    def write(body: str, name: str = "r.yaml") -> Path:
        p = tmp_path / name
        p.write_text("name: j\nscript: train.py\n" + body)
        return p

    return write


# ------------------------------------------------------------------------------------------------ bad recipes
def test_binary_recipe(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(bytes(range(256)) * 4)
    one_message(broker("plan", "--recipe", str(p)), 2, str(p), "not UTF-8", "->")


def test_latin1_recipe_names_the_line(tmp_path, job):
    p = tmp_path / "l1.yaml"
    p.write_bytes(b"name: j\nscript: train.py\n# caf\xe9\n")
    out = one_message(broker("run", str(p)), 2, f"{p}:3:", "not UTF-8", "0xe9")
    assert "iconv" in out


@pytest.mark.parametrize("command", [["run"], ["plan", "--recipe"], ["slurm", "render"]])
@pytest.mark.parametrize("content, where, what", [
    (b"\0" * 64, ":1:1:", "NUL byte"),
    (b"name: x\0\nscript: train.py\n", ":1:8:", "NUL byte"),
    (b"name: j\nscript: train.py\nname2: x\x07\n", ":3:9:", "control character 0x07"),
])
def test_control_characters_in_a_recipe_are_bad_input(tmp_path, job, command, content, where, what):
    """PyYAML's reader refuses NUL and control characters with an error that names no line; broker said "internal
    error ... this is a bug" (rc 1).  Now: rc 2, the file, line and column, and what to do."""
    p = tmp_path / "ctl.yaml"
    p.write_bytes(content)
    out = one_message(broker(*command, str(p)), 2, f"{p}{where}", what, "text editor")
    assert "internal error" not in out and "bug" not in out


def test_huge_number_is_echoed_plainly():
    """`--hours 1e9` is echoed as 1000000000 (never Python's 1e+09)."""
    out = one_message(broker("plan", "--hours", "1e9"), 2, "--hours 1000000000 is out of range")
    assert "e+" not in out


@pytest.mark.parametrize("args, needles", [
    (["--inject", "udp-blocked"], ["'udp-blocked' needs --topology hybrid", "firewall, wrong-iface, mtu",
                                   "udp-blocked, direct-blocked"]),
    (["--topology", "hybrid", "--inject", "mtu"], ["'mtu' is not one of the hybrid", "drop --topology hybrid"]),
    (["--inject", "nosuch"], ["unknown fault 'nosuch'", "firewall, wrong-iface, mtu", "udp-blocked, direct-blocked"]),
])
def test_inject_of_the_other_topology_names_the_topology(tmp_path, job, args, needles):
    """`--inject udp-blocked` without `--topology hybrid` said "unknown fault": it is a fault of the hybrid topology."""
    p = job("nodes: 2\ncpu_ok: true\nmax_hours: 0.1\n")
    one_message(broker("run", str(p), "--provider", "netns", *args, env={"BROKER_HOME": str(tmp_path / "home")}),
                2, *needles)


def test_directory_as_recipe(tmp_path):
    one_message(broker("run", str(tmp_path)), 2, str(tmp_path), "is a folder")


def test_deeply_nested_args(job):
    p = job("args: " + "[" * 5000 + "]" * 5000 + "\n")
    one_message(broker("plan", "--recipe", str(p)), 2, "nested", str(p))


@pytest.mark.parametrize("value", [".inf", "1e308", ".nan", "-.inf"])
def test_infinite_and_huge_budget_in_recipe(job, value):
    p = job(f"budget_usd: {value}\n")
    one_message(broker("plan", "--recipe", str(p)), 2, f"{p}:3:", "budget_usd", "US dollars")


@pytest.mark.parametrize("args, flag", [
    (["--budget", "inf"], "--budget"), (["--budget", "1e308"], "--budget"), (["--budget", "nan"], "--budget"),
    (["--hours", "inf"], "--hours"), (["--hours", "1e9"], "--hours"), (["--budget", "5", "--nodes", "100000"], "--nodes"),
    (["--budget", "5", "--gpus-per-node", "17"], "--gpus-per-node"), (["--budget", "5", "--disk", "inf"], "--disk"),
])
def test_plan_flags_have_the_recipe_limits(args, flag):
    cp = broker("plan", *args)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 2 and "Traceback" not in out and flag in out, out
    if "nan" not in args:  # nan is refused by the option parser itself (nan >= 0 is false)
        assert "allowed is" in out and "error:" in cp.stderr, out


def test_plan_flags_within_limits_still_plan():
    cp = broker("plan", "--budget", "100000", "--hours", "168", "--nodes", "64", "--provider", "local", "--cpu-ok")
    assert cp.returncode in (0, 3), cp.stdout + cp.stderr
    assert "Traceback" not in cp.stderr


def test_pricing_never_overflows():
    """pricing itself clamps (the planner may be called from code with any float)."""
    import math

    from broker.core.model import Offer, utcnow
    from broker.plan.pricing import MAX_SECONDS, billed_seconds, max_billed_seconds, max_hours_within, worst_case_usd

    o = Offer(provider="vast", offer_id="1", instance_type="x", gpu_name="RTX 4090", gpu_count=1, gpu_mem_gib=24,
              usd_per_hour=0.4, price_source="t", price_time=utcnow())
    assert billed_seconds(math.inf) == MAX_SECONDS
    assert worst_case_usd(o, math.inf) > 1e10
    assert max_billed_seconds(1e308, 1, 0.4) == MAX_SECONDS
    assert max_billed_seconds(math.inf, 1, 0.4) == MAX_SECONDS
    assert max_hours_within(1e308, o) > 1e10
    assert max_hours_within(1e308, [o, replace(o, usd_per_hour=0.5)]) > 1e10


# ------------------------------------------------------------------------------------------------ BROKER_HOME
def test_broker_home_naming_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    one_message(broker("status", env={"BROKER_HOME": str(f)}), 2, "BROKER_HOME", str(f), "not a folder",
                "set BROKER_HOME")


def test_broker_home_under_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    one_message(broker("status", env={"BROKER_HOME": str(f / "home")}), 2, "BROKER_HOME", "set BROKER_HOME")


def _readonly(d: Path) -> list[str]:
    """argv prefix that runs a command with ``d`` read-only: chmod for a normal user; a read-only bind mount in a
    private mount namespace for root (root ignores permission bits)."""
    if os.geteuid() != 0:
        d.chmod(0o555)
        return []
    if not shutil.which("unshare"):
        pytest.skip("root without unshare(1): cannot make a read-only folder")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespaces here: {probe.stderr.decode().strip()}")
    return ["unshare", "-m", "sh", "-c", f'mount --bind "{d}" "{d}" && mount -o remount,bind,ro "{d}" && exec "$@"',
            "sh"]


def _broker_ro(d: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run(_readonly(d) + [sys.executable, "-m", "broker", *args], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=120)


def test_broker_home_read_only(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    try:
        cp = _broker_ro(home, "status", env={"BROKER_HOME": str(home)})
        one_message(cp, 2, str(home), "not writable", "set BROKER_HOME")
    finally:
        home.chmod(0o755)


def test_broker_home_under_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    try:
        cp = _broker_ro(ro, "status", env={"BROKER_HOME": str(ro / "home")})
        one_message(cp, 2, str(ro / "home"), "set BROKER_HOME")
    finally:
        ro.chmod(0o755)


def test_ledger_that_cannot_be_opened(tmp_path):
    home = tmp_path / "home"
    (home / "ledger.sqlite").mkdir(parents=True)  # sqlite3.OperationalError: unable to open database file
    one_message(broker("status", env={"BROKER_HOME": str(home)}), 2, f"ledger ({home / 'ledger.sqlite'})",
                "cannot be used", "set BROKER_HOME")


def test_broker_home_read_only_with_json(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    cp = broker("status", "--json", env={"BROKER_HOME": str(f)})
    assert cp.returncode == 2
    err = json.loads(cp.stdout)["error"]
    assert err["exit_code"] == 2 and "not a folder" in err["message"] and "BROKER_HOME" in err["hint"]


# ------------------------------------------------------------------------------------------------ the boundary
def test_json_errors_are_one_object(job):
    p = job("nodes: true\n")
    cp = broker("plan", "--recipe", str(p), "--json")
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    err = json.loads(cp.stdout)["error"]
    assert err["type"] == "RecipeError" and err["exit_code"] == 2 and "nodes" in err["message"]


def test_json_usage_error_is_json():
    cp = broker("plan", "--json", "--no-such-flag")
    assert cp.returncode == 2
    assert "no-such-flag" in json.loads(cp.stdout)["error"]["message"]


def test_usage_error_exit_2():
    cp = broker("plan", "--no-such-flag")
    assert cp.returncode == 2 and "No such option" in cp.stderr and "Traceback" not in cp.stderr


@pytest.mark.parametrize("args, want", [(("plan", "--interruptible"), "`broker plan --help`"),
                                        (("-v", "logs", "--node"), "`broker logs --help`")])
def test_an_option_without_its_value_points_at_its_commands_help(args, want):
    """click gives no context for an option left without its value; the hint named `broker --help`."""
    cp = broker(*args)
    assert cp.returncode == 2 and "requires an argument" in cp.stderr and want in cp.stderr, cp.stderr


def _handle(exc: BaseException, capsys, **kw):
    from broker.cli.app import handle

    code = handle(exc, as_json=kw.get("as_json", False))
    return code, capsys.readouterr()


def test_unexpected_error_writes_a_crash_log(broker_home, capsys):
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError as e:
        code, out = _handle(e, capsys)
    assert code == 1
    assert "internal error:" in out.err and "ZeroDivisionError: boom" in out.err and "bug" in out.err
    log = Path(unwrapped(out.err).split("traceback is in ")[1].split(":")[0])
    assert log.parent == broker_home / "logs"
    text = log.read_text()
    assert "Traceback" in text and "ZeroDivisionError: boom" in text and "test_cli_errors.py" in text


def test_crash_log_falls_back_to_the_users_own_folder(tmp_path, monkeypatch, capsys):
    """Not a shared temp folder (another user could plant symlinks there): this user's 0700 broker-<uid>."""
    import os

    from broker.core import private
    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("BROKER_HOME", str(f))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(private, "SHORT_BASE", tmp_path / "tmp")
    try:
        raise RuntimeError("x")
    except RuntimeError as e:
        code, out = _handle(e, capsys, as_json=True)
    assert code == 1
    err = json.loads(out.out)["error"]
    log = Path(err["log"])
    assert err["type"] == "internal" and log.parent == tmp_path / "tmp" / f"broker-{os.geteuid()}" / "logs"
    assert "RuntimeError" in log.read_text()
    assert log.stat().st_mode & 0o777 == 0o600 and log.parent.stat().st_mode & 0o777 == 0o700


def test_keyboard_interrupt_is_130(capsys):
    import typer

    code, out = _handle(KeyboardInterrupt(), capsys)
    assert code == 130 and "interrupted" in out.err
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise typer.Abort() from e
    except typer.Abort as a:
        code, out = _handle(a, capsys)
    assert code == 130


def test_sigint_exits_130(tmp_path):
    """A real Ctrl-C (SIGINT) while a command runs: exit 130, one line, no traceback."""
    import signal
    import time

    e = dict(os.environ, PYTHONPATH=str(REPO), BROKER_HOME=str(tmp_path / "home"))
    code = ("import sys, time, typer; from broker.cli import app as cli\n"
            "@cli.app.command('sleep-test')\n"
            "def _s():\n    print('ready', flush=True); time.sleep(30)\n"
            "cli.main(['sleep-test'])\n")
    p = subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err


def test_provider_and_plan_errors_keep_their_codes(capsys):
    from broker.core.errors import NoValidPlan, ProviderError

    code, out = _handle(ProviderError("vast", "search", "HTTP 500", hint="retry later"), capsys)
    assert code == 4 and "vast: search failed: HTTP 500" in out.err and "retry later" in out.err
    code, _ = _handle(NoValidPlan("nothing fits"), capsys)
    assert code == 3


def test_os_error_on_a_user_file(tmp_path, capsys):
    try:
        open(tmp_path / "missing" / "x")
    except OSError as e:
        code, out = _handle(e, capsys)
    assert code == 2 and "No such file" in out.err and "check the path" in out.err


def test_crash_message_and_log_hold_no_secret(broker_home, monkeypatch, capsys):
    monkeypatch.setenv("VAST_API_KEY", "vk-0123456789abcdef")
    try:
        raise RuntimeError("GET https://console.vast.ai/api/v0/bundles?api_key=vk-0123456789abcdef&q=1 failed; "
                           "token=abcdefgh12345")
    except RuntimeError as e:
        code, out = _handle(e, capsys)
    assert code == 1 and "vk-0123" not in out.err and "abcdefgh12345" not in out.err and "api_key=***" in out.err
    log = Path(unwrapped(out.err).split("traceback is in ")[1].split(":")[0])
    text = log.read_text()
    assert "vk-0123" not in text and "abcdefgh12345" not in text and "RuntimeError" in text


# ------------------------------------------------------------------------------------------------ closed pipes
def _into_closed_pipe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`broker ARGS | head -1` without the race: stdout is a pipe whose reader is already gone, so the first write
    meets EPIPE whatever the output's size."""
    r, w = os.pipe()
    os.close(r)
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    try:
        return subprocess.run([sys.executable, "-m", "broker", *args], cwd=REPO, env=e, stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)


@pytest.mark.parametrize("args", [["offers"], ["status"], ["plan", "--budget", "5"], ["plan", "--budget", "5",
                                                                                      "--json"], ["--help"],
                                  ["run", "--help"], ["cost"]])
def test_closed_stdout_is_a_quiet_exit_141(args, broker_home):
    """Like `git log | head -1`: no message, no traceback, no "Exception ignored" at shutdown; 141 = 128 + SIGPIPE,
    what the shell reports for git or cat there."""
    cp = _into_closed_pipe(*args, env={"BROKER_HOME": str(broker_home)})
    assert cp.returncode == 141, cp.stderr
    assert cp.stderr == ""


def test_head_minus_1_through_a_shell(broker_home):
    """The real thing: `broker offers | head -1` prints the first line and nothing on stderr."""
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             BROKER_HOME=str(broker_home))
    cp = subprocess.run(["bash", "-c", f'"{sys.executable}" -m broker offers | head -1; '
                                       'echo "status=${PIPESTATUS[0]}" >&2'],
                        cwd=REPO, env=e, capture_output=True, text=True, timeout=120)
    assert cp.stdout.startswith("offers (") and len(cp.stdout.splitlines()) == 1, cp.stdout
    status = cp.stderr.strip().splitlines()[-1]
    assert cp.stderr.strip() == status and status in ("status=0", "status=141"), cp.stderr


def test_a_broken_pipe_that_is_not_stdout_is_still_an_error(tmp_path):
    """Only a closed stdout/stderr is quiet: EPIPE from another pipe (a child's stdin) is reported as a failure."""
    code = ("import subprocess, sys; from broker.cli import app as cli\n"
            "@cli.app.command('pipe-test')\n"
            "def _p():\n"
            "    raise BrokenPipeError(32, 'Broken pipe (a child process)')\n"
            "cli.main(['pipe-test'])\n")
    e = dict(os.environ, PYTHONPATH=str(REPO), BROKER_HOME=str(tmp_path / "home"))
    cp = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 1, cp.stderr
    assert "Traceback" not in cp.stderr and "internal error:" in cp.stderr and "BrokenPipeError" in cp.stderr


# ------------------------------------------------------------------------------------------------ a folder as recipe
def test_empty_folder_as_recipe_says_it_holds_none(tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    (d / "train.py").write_text("print(1)\n")
    out = one_message(broker("run", f"{d}/"), 2, "holds no recipe", "*.yaml", "broker init")
    assert "ddp_2node.yaml" not in out  # no file that is not there


def test_folder_with_recipes_names_the_real_ones(tmp_path):
    d = tmp_path / "job"
    d.mkdir()
    (d / "only.yaml").write_text("name: j\nscript: t.py\n")
    one_message(broker("run", str(d)), 2, "is a folder", str(d / "only.yaml"))
    (d / "second.yml").write_text("name: j\nscript: t.py\n")
    (d / "notes.txt").write_text("x")
    out = one_message(broker("plan", "--recipe", str(d)), 2, "is a folder", "only.yaml", "second.yml")
    assert "notes.txt" not in out and "ddp_2node.yaml" not in out


def test_closed_stdout_ends_a_command_as_systemexit_and_later_output_goes_nowhere(tmp_path):
    """The console raises OutputClosed (a SystemExit, so no `except Exception` in the pipeline takes it for a
    failed job) and what is written afterwards (teardown messages) no longer fails."""
    code = ("import sys\nfrom broker.core.ui import console\nfrom broker.core.errors import OutputClosed\n"
            "try:\n    console.print('x' * 100000)\n    sys.exit('not raised')\n"
            "except Exception:\n    sys.exit('an Exception')\n"
            "except OutputClosed as e:\n    got = e.code\n"
            "console.print('released: every resource of the run')\n"
            "sys.stderr.write(f'code={got}')\n")
    r, w = os.pipe()
    os.close(r)
    try:
        cp = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=w,
                            stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert cp.returncode == 0 and cp.stderr == "code=141", cp.stderr


# ------------------------------------------------------------------------------------------------ --json errors
def test_json_error_is_on_stdout_and_the_message_on_stderr(job):
    """As the README says: with --json the error object is on stdout (for the script) and the one-line message on
    stderr as well (for the person reading the CI log)."""
    p = job("nodes: true\n")
    cp = broker("plan", "--recipe", str(p), "--json")
    assert cp.returncode == 2
    doc = json.loads(cp.stdout)
    assert doc["schema_version"] == 1 and doc["error"]["type"] == "RecipeError"
    assert cp.stderr.startswith("error: ") and "nodes" in cp.stderr and "{" not in cp.stderr, cp.stderr


# ------------------------------------------------------------------------------------------------ misplaced options
def test_a_command_option_before_the_command_says_where_it_goes():
    cp = broker("--json", "status")
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    assert "--json goes after the command: broker status --json" in cp.stderr, cp.stderr
    assert "Possible options" not in cp.stderr and "--version" not in cp.stderr, cp.stderr
    cp = broker("--json", "quota", "status")
    assert "--json goes after the command: broker quota status --json" in cp.stderr, cp.stderr
    doc = json.loads(cp.stdout)  # --json anywhere: the error is JSON too, with the same hint
    assert doc["error"]["hint"] == "--json goes after the command: broker quota status --json"
    assert doc["error"]["message"] == "No such option: --json"


def test_an_option_of_another_command_names_that_command_not_a_random_one(tmp_path):
    cp = broker("run", "--min-gpu-mem", "5", str(tmp_path / "r.yaml"))
    assert cp.returncode == 2
    assert "Possible options" not in cp.stderr and "--quiet" not in cp.stderr, cp.stderr
    assert "--min-gpu-mem is an option of broker offers, broker plan, not of broker run" in unwrapped(cp.stderr), \
        cp.stderr
    cp = broker("run", "--recipe", str(tmp_path / "r.yaml"))
    assert "broker run takes RECIPE as an argument: broker run RECIPE" in unwrapped(cp.stderr), cp.stderr


def test_a_typo_keeps_its_real_suggestion():
    cp = broker("plan", "--budgt", "5")
    assert cp.returncode == 2 and "(Possible options: --budget)" in cp.stderr, cp.stderr


# ------------------------------------------------------------------------------------------------ closed stderr
@pytest.mark.parametrize("args", [["status", "nosuch"], ["plan", "--bogus"], ["--json", "status"]])
def test_a_closed_stderr_keeps_the_errors_exit_code(args, broker_home):
    """`broker status nosuch 2>&1 | head -0`: the message cannot be written, but the exit code is still the
    error's (2), not 1; no "Exception ignored" either (stderr is gone)."""
    r, w = os.pipe()
    os.close(r)
    e = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             BROKER_HOME=str(broker_home))
    try:
        cp = subprocess.run([sys.executable, "-m", "broker", *args], cwd=REPO, env=e, stdout=subprocess.PIPE,
                            stderr=w, text=True, timeout=120)
    finally:
        os.close(w)
    assert cp.returncode == 2, cp.stdout


def test_json_mode_stderr_message_is_one_line_and_the_hint_gives_one_example():
    """With --json the stderr message is one line whatever the width (a CI log is grepped), and the budget hint
    says "e.g." once."""
    cp = broker("plan", "--budget", "0", "--json", env={"COLUMNS": "80", "BROKER_NO_WRAP": "0"})
    assert cp.returncode == 2
    lines = cp.stderr.splitlines()
    assert lines[0].startswith("error: --budget") and len(lines) == 2, cp.stderr
    assert lines[1].startswith("  -> ") and cp.stderr.count("e.g.") == 1, cp.stderr
    assert json.loads(cp.stdout)["error"]["exit_code"] == 2


@pytest.mark.parametrize("byte, caret", [(b"\x1b", "^["), (b"\x7f", "^?"), (b"\x07", "^G"), (b"\x01", "^A")])
def test_control_character_hint_names_its_caret_form(tmp_path, job, byte, caret):
    """The hint said `cat -A` shows the character "as ^@ or ^G" whatever it was: ESC shows as ^[ and DEL as ^?."""
    p = tmp_path / "ctl.yaml"
    p.write_bytes(b"name: j\nscript: train.py\nname2: x" + byte + b"\n")
    out = one_message(broker("plan", "--recipe", str(p)), 2, f"{p}:3:9:", f"shows it as {caret})")
    assert "^@ or ^G" not in out


@pytest.mark.parametrize("encoding, raw_prefix, name", [
    ("utf-16", b"", "UTF-16"),          # Python writes the LE BOM 0xff 0xfe
    ("utf-16-be", b"\xfe\xff", "UTF-16"),
    ("utf-16-le", b"", "UTF-16LE"),     # no BOM: a NUL every other byte
    ("utf-32", b"", "UTF-32"),
])
def test_utf16_recipe_is_named_and_converted_from_utf16(tmp_path, job, encoding, raw_prefix, name):
    """A UTF-16 recipe was told `iconv -f latin1` (or "NUL byte at line 1"): name the encoding and convert from it."""
    p = tmp_path / "wide.yaml"
    p.write_bytes(raw_prefix + "name: j\nscript: train.py\n".encode(encoding))
    out = one_message(broker("plan", "--recipe", str(p)), 2, str(p), f"{name}", f"iconv -f {name} -t UTF-8")
    assert "latin1" not in out and "NUL byte at" not in out


@pytest.mark.parametrize("args", [["plan", "-v"], ["status", "-v"], ["status", "--verbose"]])
def test_a_root_option_after_the_command_says_it_goes_before(args):
    """`broker plan -v` said only "No such option: -v": -v is broker's own option, before the command."""
    cp = broker(*args)
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    opt = args[1]
    assert f"{opt} is an option of broker itself: broker {opt} {args[0]} ..." \
        in unwrapped(cp.stderr), cp.stderr


def test_a_command_option_with_a_value_before_the_command_says_it_goes_after():
    """`broker --budget 5 plan` listed every command with --budget "not of broker": it goes after the command."""
    cp = broker("--budget", "5", "plan")
    assert cp.returncode == 2 and "Traceback" not in cp.stderr
    assert "--budget goes after the command: broker plan --budget 5" \
        in unwrapped(cp.stderr), cp.stderr


def test_a_plan_option_on_run_names_the_recipe_field(tmp_path):
    """`broker run --budget 5 RECIPE`: a recipe run's budget is the recipe's budget_usd field (--budget is for
    `broker run SCRIPT.py`)."""
    cp = broker("run", "--budget", "5", str(tmp_path / "r.yaml"))
    assert cp.returncode == 2
    assert "for a run of a recipe it is the recipe's `budget_usd:` field" in unwrapped(cp.stderr), cp.stderr
    cp = broker("run", "--hours", "1", str(tmp_path / "r.yaml"))
    assert "`max_hours:` field" in unwrapped(cp.stderr), cp.stderr


@pytest.mark.parametrize("args, suggested", [
    (["--inject", "udp-blocked"], "--provider netns --topology hybrid --inject udp-blocked"),
    (["--topology", "hybrid", "--inject", "direct-blocked"], "--provider netns --topology hybrid --inject direct-blocked"),
    (["--inject", "mtu"], "--provider netns --inject mtu"),
])
def test_inject_without_netns_suggests_the_matching_command(tmp_path, job, args, suggested):
    """`broker run R --inject udp-blocked` (no --provider) hinted `--provider netns --inject firewall`: a command that
    injects another fault and would then fail for want of --topology hybrid.  Now it suggests the same fault."""
    p = job("nodes: 2\ncpu_ok: true\nmax_hours: 0.1\n")
    out = one_message(broker("run", str(p), *args, env={"BROKER_HOME": str(tmp_path / "home")}), 2,
                      f"broker run {p} {suggested}")
    if "hybrid" not in suggested:
        assert "--topology hybrid" not in out, out
