"""``broker stop RUN`` / ``broker start RUN``: stop a run's rented machines keeping their disks, start them again.

Where the provider can (:attr:`broker.core.provider.Provider.stoppable`: Vast.ai, OCI, AWS and the pretend
``fake``).  Ledger-first, as every change of what bills: each machine's row goes ``stopping`` (with the disk's
deadline and its stopped rate) *before* the provider's stop call and ``stopped`` once ``describe_instance``
confirms it; a start writes ``starting`` (full rate again, a new deadline) before the call and ``running`` with the
machine's new addresses after it.  Until the stop is confirmed the full rate is counted; from the start request on
it is again (:mod:`broker.money.accounting`).

Deadlines: a stopped disk still bills, so it keeps a deadline: ``--hours`` (default 24) from the stop, after which
the watchdog deletes it like any other resource (``broker stop`` starts the watchdog).  A started machine gets
``--hours`` from the start (default: the recipe's ``max_hours``).  The node-side dead-man switch of the first boot
is not counted on after a stop (``attrs["deadman"] = False``); once a started node answers SSH, ``broker start``
arms its switch again for the new deadline (the adapter's :meth:`~broker.core.provider.Provider.deadman_rearm_script`,
the boot mechanism's own code, run with the run's key) and records ``attrs["deadman"] = True`` only when the node
prints that it is armed; otherwise it says so, and the watchdog and the deadline are the layers left.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import typer

from broker.core.prose import usd


def _cannot_stop_hint(run: Any, down_does: str) -> str:
    """The hint of a refused stop: ``broker down`` and the providers whose machines can be stopped."""
    from broker.providers import PRETEND, STOPPABLE

    return (f"`broker down {run.id}` {down_does}; machines on "
            f"{', '.join(p for p in STOPPABLE if p not in PRETEND)} can be stopped and started")


def _refuse_unstoppable(run: Any) -> None:
    """Raise BadInput with the reason the run's provider declares when its machines cannot be stopped at all (a
    local run: processes on this machine), before anything about the run's state: following a hint about its
    state (wait for the job, keep the nodes) would lead nowhere."""
    from broker.core.provider import BadInput
    from broker.providers import capability, known, why_not

    if run.provider and known(run.provider) and not capability(run.provider, "stoppable"):
        raise BadInput(f"run {run.id} ran on {run.provider}, whose machines cannot be stopped keeping their disks "
                       f"({why_not(run.provider, 'stop')})",
                       hint=_cannot_stop_hint(run, "ends what is left of it"))


def _stoppable_rows(ledger: Any, run: Any, states: tuple[str, ...]) -> list[Any]:
    from broker.core.provider import BadInput
    from broker.providers import capability, why_not

    rows = [r for r in ledger.resources(run.id, live_only=True) if r.kind in ("instance", "netns_node")]
    if not rows:
        raise BadInput(f"run {run.id} has no live machines (status {run.status})",
                       hint=f"`broker status {run.id}` shows what it did")
    cannot = sorted({r.provider for r in rows if not capability(r.provider, "stoppable")})
    if cannot:
        why = "; ".join(f"{p}: {why_not(p, 'stop')}" for p in cannot)  # the reason each provider declares
        raise BadInput(f"the machines of run {run.id} cannot be stopped keeping their disks ({why})",
                       hint=_cannot_stop_hint(run, "ends them"))
    picked = [r for r in rows if r.state in states and r.provider_id]
    return picked


#: seconds between the progress lines of a wait (a silent wait of minutes looked like a hang)
PROGRESS_EVERY_S = 15.0


def _progress(say: Any, what: str, t0: float, timeout_s: float, last: list[float]) -> None:
    """``say`` one line about a wait every :data:`PROGRESS_EVERY_S` seconds: what, how long, how long at most."""
    now = time.monotonic()
    if say is not None and now - last[0] >= min(PROGRESS_EVERY_S, max(1.0, timeout_s / 4)):
        last[0] = now
        say(f"{what} after {now - t0:.0f} s; waiting at most {max(0.0, timeout_s - (now - t0)):.0f} s more")


def _wait_state(p: Any, res: Any, want: str, timeout_s: float, poll_s: float, say: Any = None) -> Any:
    """describe_instance until it reports ``want`` (or ``terminated``), at most ``timeout_s`` seconds; a progress
    line to ``say`` every :data:`PROGRESS_EVERY_S` seconds."""
    t0 = time.monotonic()
    last = [t0]
    while True:
        info = p.describe_instance(res.provider_id, region=res.region)
        if info.state in (want, "terminated") or time.monotonic() - t0 >= timeout_s:
            return info
        _progress(say, f"{res.provider} {res.provider_id} is {info.raw_state or info.state}", t0, timeout_s, last)
        time.sleep(poll_s)


def _retrying(call: Any, timeout_s: float, poll_s: float) -> None:
    """``call()``, again on TransientError (e.g. OCI's 409 IncorrectState while a stop is still settling: AWS and
    OCI report ``stopping`` as stopped) until ``timeout_s`` seconds have passed; then the error stands."""
    from broker.core.provider import TransientError

    t0 = time.monotonic()
    while True:
        try:
            return call()
        except TransientError:
            if time.monotonic() - t0 >= timeout_s:
                raise
            time.sleep(max(poll_s, 0.05))


def stop_run(ledger: Any, run_id: str, *, hours: float = 24.0, timeout_s: float = 600.0, poll_s: float = 2.0,
             providers: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Stop every running machine of ``run_id`` (ledger-first, see the module docstring); returns one dict per
    machine: ``provider``, ``provider_id``, ``state`` (``stopped``, or ``stopping`` when not confirmed within
    ``timeout_s`` seconds), ``usd_per_hour`` (while stopped, $/h), ``basis``, ``deadline``.  Raises BadInput (the
    run's CLI still drives its job; nothing to stop; a provider that cannot stop), the provider's errors."""
    from broker.core.model import utcnow
    from broker.core.provider import BadInput
    from broker.money.accounting import ACTIVE_STATUSES, cli_alive
    from broker.providers import get_provider

    run = ledger.find_run(run_id)
    _refuse_unstoppable(run)
    if run.status in ACTIVE_STATUSES and cli_alive(run.pid, run.pid_start):
        raise BadInput(f"run {run.id} is still {run.status} (its CLI, pid {run.pid}, drives the job): stopping its "
                       "machines now would fail the job and the CLI would delete them",
                       hint=f"wait for the job to end (with --idle-minutes its machines stay for `broker stop`), "
                            f"or `broker down {run.id}`")
    rows = _stoppable_rows(ledger, run, ("running", "stopping"))
    if not rows:
        raise BadInput(f"run {run.id} has no running machines to stop",
                       hint=f"`broker status {run.id}` shows their state; `broker start {run.id}` starts stopped ones")
    cache = dict(providers or {})
    out = []
    for res in rows:
        p = cache.setdefault(res.provider, get_provider(res.provider) if res.provider not in cache else None)
        rate, basis = p.stopped_rate(res.provider_id, region=res.region, attrs=res.attrs)
        deadline = utcnow() + timedelta(hours=hours)
        what = f"{res.provider} {res.kind} {res.provider_id}"
        # ledger first: the row says a stop is under way (full rate still counted) before the provider hears it;
        # a ledger that cannot take it stops the command here (nothing changed), never the writes after the call
        first = getattr(ledger, "raw", ledger)
        first.update_resource(res.id, state="stopping", deadline=deadline, stopped_usd_per_hour=rate,
                              attrs={"stopped_basis": basis, "deadman": False}, actor="cli",
                              message=f"stop requested; {what} will bill {usd(rate, up_to=4)}/h ({basis}) until "
                                      f"{deadline:%Y-%m-%d %H:%MZ}")
        try:
            p.stop(res.provider_id, region=res.region)
        except Exception as e:
            try:  # refused: back to what it was, unless the provider shows the stop under way after all
                running = p.describe_instance(res.provider_id, region=res.region).state == "running"
            except Exception:  # noqa: BLE001 - cannot tell: the row stays `stopping` (full rate, its deadline)
                running = False
            if running:
                ledger.update_resource(res.id, state=res.state, deadline=res.deadline, actor="cli",
                                       message=f"stop of {what} failed: {getattr(e, 'message', e)}")
            raise
        info = _wait_state(p, res, "stopped", timeout_s, poll_s)
        if info.state == "stopped":
            ledger.change_rate(res.id, "stopped", at=utcnow(), actor="cli",
                               message=f"{what} stopped ({info.raw_state}); billing {usd(rate, up_to=4)}/h for its "
                                       "disk")
        elif info.state == "terminated":
            ledger.update_resource(res.id, state="terminated", terminated_by="provider", actor="cli",
                                   message=f"{what} is gone at the provider")
        out.append({"resource": res.id, "provider": res.provider, "provider_id": res.provider_id,
                    "state": info.state if info.state in ("stopped", "terminated") else "stopping",
                    "usd_per_hour": rate, "running_usd_per_hour": res.usd_per_hour, "basis": basis,
                    "deadline": deadline.isoformat()})
    return out


def start_run(ledger: Any, run_id: str, *, hours: float | None = None, timeout_s: float = 600.0,
              poll_s: float = 2.0, providers: dict[str, Any] | None = None,
              ssh_check: bool = True, say: Any = None) -> list[dict[str, Any]]:
    """Start every stopped machine of ``run_id`` again: budget checked, ledger-first (``starting`` before the call),
    then the new addresses written to the ledger and the run's ``cluster.json`` and SSH tried on each node.
    Returns one dict per machine (``provider_id``, ``state``, ``host``, ``port``, ``ssh``: True / False / None not
    tried, ``deadline``, ``deadman``: True re-armed and confirmed by the node / False not re-armed (``deadman_why``
    says why) / None the provider has no node-side switch or SSH was not tried, ``deadman_fire_at`` ISO time;
    ``error`` and ``fix`` where the provider's answer could not be recorded (a malformed address or id: the
    machine is stopped again, ``state`` says whether that was confirmed, ``fix`` is the command that ends it),
    ``ssh_why`` where SSH was refused for a changed host key).  ``say``: one line per step and a progress line
    every :data:`PROGRESS_EVERY_S` seconds of a wait.  Raises BadInput (nothing stopped; a provider that cannot), NoValidPlan (the budget left
    does not cover ``hours`` at the full rate: exit 3), the provider's errors."""
    from broker.core.answers import instance_answer_problem
    from broker.core.model import utcnow
    from broker.core.provider import BadInput, NoValidPlan
    from broker.money.accounting import run_cost
    from broker.providers import get_provider

    run = ledger.find_run(run_id)
    _refuse_unstoppable(run)
    rows = _stoppable_rows(ledger, run, ("stopped", "stopping", "starting"))
    if not rows:
        raise BadInput(f"run {run.id} has no stopped machines", hint=f"`broker stop {run.id}` stops them")
    if hours is None:
        hours = float((run.recipe or {}).get("max_hours") or 1.0)
    now = utcnow()
    if run.budget_usd is not None:
        spent = run_cost(run, ledger.resources(run.id), now).spent_usd
        hourly = sum(r.usd_per_hour for r in rows)
        worst = spent + hourly * hours
        if worst > run.budget_usd + 1e-9:
            fit = max(0.0, (run.budget_usd - spent) / hourly) if hourly else 0.0
            raise NoValidPlan(f"starting run {run.id} for {hours:g} h at {usd(hourly)}/h brings it to "
                              f"{usd(worst)}, over its budget {usd(run.budget_usd)} (spent {usd(spent)})",
                              hint=(f"`broker start {run.id} --hours {int(fit * 100) / 100:g}`" if fit >= 0.01 else
                                    f"`broker down {run.id}` deletes the stopped disks"))
    cache = dict(providers or {})
    out = []
    started = {}
    for res in rows:
        p = cache.setdefault(res.provider, get_provider(res.provider) if res.provider not in cache else None)
        started[res.id] = (p, res)
        deadline = utcnow() + timedelta(hours=hours)
        what = f"{res.provider} {res.kind} {res.provider_id}"
        at = utcnow()
        getattr(ledger, "raw", ledger).change_rate(res.id, "starting", at=at, deadline=deadline, actor="cli",
                           attrs={"restarted_at": at.isoformat()},
                           message=f"start requested; {what} bills {usd(res.usd_per_hour, up_to=4)}/h again until "
                                   f"{deadline:%Y-%m-%d %H:%MZ}")
        if say is not None:
            say(f"{what}: start requested (bills {usd(res.usd_per_hour, up_to=4)}/h from now)")
        _retrying(lambda: p.start(res.provider_id, region=res.region), timeout_s, poll_s)
        info = _wait_state(p, res, "running", timeout_s, poll_s, say)
        row = {"resource": res.id, "provider": res.provider, "provider_id": res.provider_id, "state": info.state,
               "host": info.ssh_host, "port": info.ssh_port, "ssh": None, "deadline": deadline.isoformat(),
               "usd_per_hour": res.usd_per_hour, "deadman": None, "deadman_why": None, "deadman_fire_at": None}
        bad = instance_answer_problem(info, res.provider_id) if info.state == "running" else None
        if bad is not None:  # never recorded: the machine is accounted for at its full rate, then stopped again
            row.update(host=None, port=None, error=f"{res.provider}: describe_instance of {res.provider_id} {bad}; "
                                                  "the answer was not recorded")
            ledger.update_resource(res.id, state="running", actor="cli",
                                   message=f"{what} running again, but {row['error']}")
            _stop_again(ledger, p, res, row, run, timeout_s=timeout_s, poll_s=poll_s)
        elif info.state == "running":
            ledger.update_resource(res.id, state="running", actor="cli", attrs={
                "public_ip": info.public_ip, "private_ip": info.private_ip, "ssh_host": info.ssh_host,
                "ssh_port": info.ssh_port}, message=f"{what} running again at {info.ssh_host}:{info.ssh_port}")
        elif info.state == "terminated":
            ledger.update_resource(res.id, state="terminated", terminated_by="provider", actor="cli",
                                   message=f"{what} is gone at the provider")
        out.append(row)
    _refresh_cluster(ledger, run, out)
    if ssh_check:
        _check_ssh(run, out, p_timeout=timeout_s, say=say)
        _rearm_deadman(ledger, run, out, started, hours=hours)
    return out


def _stop_again(ledger: Any, p: Any, res: Any, row: dict[str, Any], run: Any, *, timeout_s: float,
                poll_s: float) -> None:
    """Stop a started machine whose provider answer broker could not record (ledger-first, as ``stop_run``): sets
    ``row["state"]`` (``stopped`` when confirmed) and ``row["fix"]`` (the command that ends it otherwise)."""
    from broker.core.model import utcnow

    what = f"{res.provider} {res.kind} {res.provider_id}"
    row["fix"] = f"broker down {run.id}"
    try:
        rate, basis = p.stopped_rate(res.provider_id, region=res.region, attrs=res.attrs)
        ledger.update_resource(res.id, state="stopping", stopped_usd_per_hour=rate, actor="cli",
                               attrs={"stopped_basis": basis, "deadman": False},
                               message=f"stopping {what} again: its provider answer could not be recorded")
        p.stop(res.provider_id, region=res.region)
        info = _wait_state(p, res, "stopped", timeout_s, poll_s)
    except Exception as e:  # noqa: BLE001 - it stays running, accounted for, with the command that ends it
        ledger.update_resource(res.id, state="running", actor="cli",
                               message=f"stopping {what} again failed: {getattr(e, 'message', e)}; "
                                       f"`{row['fix']}` ends it")
        row["state"] = "running"
        return
    if info.state == "stopped":
        ledger.change_rate(res.id, "stopped", at=utcnow(), actor="cli",
                           message=f"{what} stopped again ({info.raw_state}); billing {usd(rate, up_to=4)}/h for "
                                   "its disk")
        row["state"] = "stopped"
    else:
        row["state"] = "stopping" if info.state != "terminated" else "terminated"


def _refresh_cluster(ledger: Any, run: Any, rows: list[dict[str, Any]]) -> None:
    """Write the started machines' new SSH host / port into the run's ``cluster.json`` (providers hand out a new
    address on start), so ``broker ssh`` / ``exec`` reach them."""
    from broker.core.private import write_private
    from broker.core.records import Cluster
    from broker.core.runfolder import confined_run_dir

    try:
        path = confined_run_dir(run) / "cluster.json"
        cluster = Cluster.model_validate_json(path.read_text())
    except (OSError, ValueError, Exception):  # noqa: BLE001 - no stored cluster (fake / local): nothing to refresh
        return
    by_res = {r["resource"]: r for r in rows if r["state"] == "running" and r["host"]}
    nodes = []
    for n in cluster.nodes:
        r = by_res.get(n.resource_id or "")
        nodes.append(n.model_copy(update={"host": r["host"], "port": int(r["port"] or 22)}) if r else n)
    write_private(path, cluster.model_copy(update={"nodes": nodes}).model_dump_json(indent=2))


def _check_ssh(run: Any, rows: list[dict[str, Any]], *, p_timeout: float, say: Any = None) -> None:
    """Log in to every started node once (``ssh ... true`` with the run's key), retrying while sshd comes up, at
    most ``p_timeout`` seconds (a progress line to ``say`` every :data:`PROGRESS_EVERY_S` s); records ``ssh`` True /
    False per row."""
    import subprocess

    from broker.cli.day2 import ssh_argv
    from broker.core.records import Cluster
    from broker.core.runfolder import confined_run_dir

    try:
        cluster = Cluster.model_validate_json((confined_run_dir(run) / "cluster.json").read_text())
    except Exception:  # noqa: BLE001 - no cluster record: nothing to log in to
        return
    for r in rows:
        idx = next((i for i, n in enumerate(cluster.nodes) if n.resource_id == r["resource"]), None)
        if idx is None or r["state"] != "running" or r.get("error") or cluster.nodes[idx].local:
            continue
        argv = ssh_argv(cluster, idx, ["true"])
        argv[1:1] = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
        t0 = time.monotonic()
        last = [t0]
        r["ssh"] = False
        while time.monotonic() - t0 < p_timeout:
            _progress(say, f"{r['provider']} {r['provider_id']}: SSH at {r['host']}:{r['port']} does not answer yet",
                      t0, p_timeout, last)
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
            if proc.returncode == 0:
                r["ssh"] = True
                break
            if b"HOST IDENTIFICATION HAS CHANGED" in proc.stderr or b"Host key verification failed" in proc.stderr:
                # the same machine (its resource id) answers with another key than broker pinned: never retried
                r["ssh_why"] = (f"the machine at {r['host']}:{r['port']} presented a host key other than the one "
                                "broker pinned for this machine: possibly a man-in-the-middle on its new address, or "
                                "the machine was rebuilt; nothing was sent to it")
                break
            time.sleep(1.0)


def _rearm_deadman(ledger: Any, run: Any, rows: list[dict[str, Any]], started: dict[str, tuple[Any, Any]], *,
                   hours: float, timeout_s: float = 120.0) -> None:
    """Arm the node-side dead-man switch of every started machine that answered SSH again, for its new deadline
    + the row's grace (``attrs["deadman_grace_s"]``, else :func:`broker.core.nodescripts.deadman_grace_s`): the
    adapter's script goes to ``bash -s`` over SSH with the run's key, at most ``timeout_s`` seconds per node.  The
    ledger says ``deadman`` True (with ``deadman_fire_at``) only when the node printed the confirmation for that
    exact fire time; anything else is recorded as not armed, with why.  Sets ``deadman`` / ``deadman_why`` /
    ``deadman_fire_at`` in each row."""
    import subprocess
    from datetime import datetime, timezone

    from broker.cli.day2 import ssh_argv
    from broker.core.nodescripts import deadman_fire_at, deadman_grace_s, read_armed
    from broker.core.records import Cluster
    from broker.core.runfolder import confined_run_dir
    from broker.core.ui import node_text
    from broker.money.accounting import switch_armable

    try:
        cluster = Cluster.model_validate_json((confined_run_dir(run) / "cluster.json").read_text())
    except Exception:  # noqa: BLE001 - no cluster record: no node to reach
        cluster = None
    for r in rows:
        p, res = started[r["resource"]]
        if r["state"] != "running" or not switch_armable(res):
            continue  # gone, or a machine that held no switch (no provider switch, no OCI principal): none lost
        what = f"{res.provider} {res.kind} {res.provider_id}"
        grace = (res.attrs or {}).get("deadman_grace_s")
        grace = float(grace) if isinstance(grace, (int, float)) else deadman_grace_s(hours)
        deadline = datetime.fromisoformat(r["deadline"])
        fire_at = deadman_fire_at(deadline, grace)
        idx = None if cluster is None else next(
            (i for i, n in enumerate(cluster.nodes) if n.resource_id == r["resource"]), None)
        script = p.deadman_rearm_script(deadline, grace, attrs=res.attrs)
        why = None
        if script is None:
            why = f"broker cannot re-arm {res.provider}'s node-side switch over SSH"
        elif idx is None:
            why = "the run's cluster.json does not list this machine, so broker cannot log in to it"
        elif r["ssh"] is not True:
            why = r.get("ssh_why") or "SSH did not answer"
        else:
            argv = ssh_argv(cluster, idx, ["bash", "-s"])
            argv[1:1] = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
            try:
                proc = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=timeout_s)
                got = read_armed(proc.stdout)
                if got != fire_at:
                    said = (proc.stderr or proc.stdout or "").strip().splitlines()
                    tail = node_text(said[-1])[:200] if said else ""
                    why = f"the node did not confirm it (exit {proc.returncode}{': ' + tail if tail else ''})"
            except subprocess.TimeoutExpired:
                why = f"the node did not answer within {timeout_s:g} s"
        fire_iso = datetime.fromtimestamp(fire_at, timezone.utc).isoformat()
        if why is None:
            r.update(deadman=True, deadman_fire_at=fire_iso)
            ledger.update_resource(res.id, actor="cli", attrs={"deadman": True, "deadman_fire_at": fire_iso,
                                                               "deadman_grace_s": grace, "deadman_why": None},
                                   message=f"dead-man switch of {what} re-armed: the node deletes itself at "
                                           f"{fire_iso[:19]}Z (deadline + {grace:g} s)")
        else:
            r.update(deadman=False, deadman_why=why)
            ledger.update_resource(res.id, actor="cli", attrs={"deadman": False, "deadman_why": why},
                                   message=f"dead-man switch of {what} NOT re-armed ({why}); the watchdog still "
                                           "guards its deadline")


def _billing_lines(ledger: Any, run_id: str) -> list[str]:
    """``provider id state $/h`` for each of the run's machines that still bills (a stopped one: its disk's
    rate), from the ledger."""
    out = []
    for r in ledger.resources(run_id, live_only=True):
        if r.state == "terminated":
            continue
        rate = (r.stopped_usd_per_hour or 0.0) if r.state == "stopped" else r.usd_per_hour
        what = "stopped (its disk)" if r.state == "stopped" else r.state
        out.append(f"{r.provider} {r.provider_id or r.name} {what} {usd(rate, up_to=4)}/h")
    return out


def stop_cmd(
    run_id: str = typer.Argument("latest", metavar="[RUN]", help="run id, a unique prefix or latest"),
    hours: float = typer.Option(24.0, "--hours", metavar="HOURS", help="delete the stopped machines this many "
                                "hours from now unless started again (their disks bill until then)"),
    timeout: float = typer.Option(600.0, "--timeout", metavar="SECONDS", help="how long to wait for the "
                                  "provider to confirm"),
    no_watchdog: bool = typer.Option(False, "--no-watchdog", help="do not start the detached watchdog (the "
                                     "stopped disks' deadline then rests on a later `broker watchdog`)"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Stop RUN's rented machines keeping their disks; `broker start RUN` resumes them, `broker down` deletes."""
    from broker.core.limits import check_number
    from broker.core.ui import console, print_json
    from broker.money.ledger import Ledger

    check_number("--hours", "max_hours", hours)
    from broker.money.journal import failsafe

    ledger = failsafe(Ledger())  # what the provider did is kept and journalled if the ledger cannot take it
    run = ledger.find_run(run_id)
    rows = stop_run(ledger, run.id, hours=hours, timeout_s=timeout)
    from broker.core.config import settings

    if not no_watchdog and settings().broker_watchdog_autostart:  # the stopped disks' deadline needs it
        from broker.money.watchdog import start_detached

        start_detached()
    if as_json:
        print_json({"run_id": run.id, "machines": rows})
        return
    for r in rows:
        what = f"{r['provider']} instance {r['provider_id']}"
        if r["state"] == "stopped":
            console.print(f"{what}: stopped, billing {usd(r['usd_per_hour'], up_to=4)}/h for its disk ({r['basis']}); "
                          f"deleted at {r['deadline'][:16]}Z unless started", markup=False, highlight=False)
        elif r["state"] == "terminated":
            console.print(f"{what}: gone at the provider", markup=False, highlight=False)
        else:
            console.print(f"{what}: stop requested, not confirmed within {timeout:g} s; `broker status` "
                          "shows it, `broker stop` again confirms", markup=False, highlight=False)
        if r["usd_per_hour"] >= 0.5 * (r["running_usd_per_hour"] or 0) > 0:
            console.print(f"  note: stopped it still bills {usd(r['usd_per_hour'], up_to=4)}/h of its "
                          f"{usd(r['running_usd_per_hour'], up_to=4)}/h; only `broker down {run.id}` ends that",
                          markup=False, highlight=False)
    console.print(f"  start it:  broker start {run.id}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  delete it: broker down {run.id}", markup=False, highlight=False, soft_wrap=True)
    if any(r["state"] == "stopping" for r in rows):
        raise typer.Exit(4)


def start_cmd(
    run_id: str = typer.Argument("latest", metavar="[RUN]", help="run id, a unique prefix or latest"),
    hours: float = typer.Option(None, "--hours", metavar="HOURS", help="delete the machines this many hours "
                                "from now (default: the recipe's max_hours)"),
    timeout: float = typer.Option(600.0, "--timeout", metavar="SECONDS", help="how long to wait for each "
                                  "machine to run and answer SSH"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Start RUN's stopped machines; their new addresses go to the run's records, then SSH is tried."""
    from broker.core.limits import check_number
    from broker.core.ui import console, print_json
    from broker.money.ledger import Ledger

    if hours is not None:
        check_number("--hours", "max_hours", hours)
    from broker.core.ui import err
    from broker.money.journal import failsafe

    ledger = failsafe(Ledger())  # what the provider did is kept and journalled if the ledger cannot take it
    run = ledger.find_run(run_id)
    say = None if as_json else (lambda line: err.print(line, markup=False, highlight=False))
    try:
        rows = start_run(ledger, run.id, hours=hours, timeout_s=timeout, say=say)
    except BaseException:  # Ctrl-C, SIGTERM, a provider error: say what this start left billing
        billing = _billing_lines(ledger, run.id)
        if billing and not as_json:
            err.print("start did not finish; still rented and billing: " + "; ".join(billing)
                      + f" (`broker stop {run.id}` stops them, `broker down {run.id}` deletes them)",
                      markup=False, highlight=False)
        raise
    bad = [r for r in rows if r["state"] != "running" or r["ssh"] is False or r.get("error")]
    if as_json:
        print_json({"run_id": run.id, "machines": rows})
    else:
        for r in rows:
            what = f"{r['provider']} instance {r['provider_id']}"
            if r.get("error"):
                now = {"stopped": "stopped again", "running": "STILL RUNNING and billing"}.get(r["state"],
                                                                                            r["state"])
                console.print(f"{what}: {r['error']}; {now}; `{r['fix']}` ends it", markup=False,
                              highlight=False, soft_wrap=True)
                continue
            if r["state"] != "running":
                console.print(f"{what}: {r['state']} (not running within {timeout:g} s)", markup=False,
                              highlight=False)
                continue
            ssh = {True: "SSH answers", False: "SSH does not answer yet", None: "no SSH to check"}[r["ssh"]]
            if r.get("ssh_why"):
                ssh = f"SSH refused: {r['ssh_why']}"
            console.print(f"{what}: running at {r['host']}:{r['port']}, {usd(r['usd_per_hour'], up_to=4)}/h, "
                          f"{ssh}; deleted at {r['deadline'][:16]}Z", markup=False, highlight=False)
            if r["deadman"] is True:
                console.print(f"  node dead-man switch re-armed: it deletes itself at "
                              f"{r['deadman_fire_at'][:19]}Z", markup=False, highlight=False)
            elif r["deadman"] is False:
                console.print(f"  node dead-man switch NOT re-armed ({r['deadman_why']}): only the watchdog "
                              "guards the deadline (`broker watchdog` must be running)", markup=False,
                              highlight=False)
        if any(r["state"] == "running" and r["ssh"] is not False and not r.get("error") for r in rows):
            console.print(f"  log in:    broker ssh {run.id}", markup=False, highlight=False, soft_wrap=True)
        billing = _billing_lines(ledger, run.id)
        if billing:
            console.print(f"  still rented and billing: {'; '.join(billing)}", markup=False, highlight=False)
            console.print(f"  stop it:   broker stop {run.id}", markup=False, highlight=False, soft_wrap=True)
            console.print(f"  delete it: broker down {run.id}", markup=False, highlight=False, soft_wrap=True)
        else:
            console.print("  nothing of this run bills now", markup=False, highlight=False)
    if bad:
        raise typer.Exit(4)
