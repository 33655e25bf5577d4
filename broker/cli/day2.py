"""Day-2 commands: ``broker logs``, ``broker ssh``, ``broker exec``, ``broker cost``, ``broker clean``.

All read the ledger; RUN may be a unique prefix of a run id (as in ``broker status``).  ``exec`` runs through the one
pipeline (:class:`broker.run.kept.KeptTarget`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Optional

import typer


def refuse_stopped(ledger: Any, run_id: str) -> None:
    """Raise BadInput when the machines of run ``run_id`` are stopped (``broker ssh`` / ``exec`` would wait for a
    machine that is off), naming ``broker start``; nothing when the run is unknown or not stopped."""
    from broker.core.provider import BadInput

    try:
        run = ledger.find_run(run_id)
    except BadInput:
        return  # the caller's own lookup says why
    off = [r for r in ledger.resources(run.id, live_only=True) if r.state in ("stopping", "stopped")]
    if off:
        raise BadInput(f"the machines of run {run.id} are stopped ({', '.join(r.provider_id or r.name for r in off)})",
                       hint=f"`broker start {run.id}` starts them again (a new address, SSH checked)")


def _node_log(run: Any, node: int) -> Path:
    """Node ``node``'s log, confined to the run's folder (:func:`broker.core.runfolder.confined_log`: a ledger row's
    ``log_paths`` / ``run_dir`` never name a file elsewhere)."""
    from broker.core.runfolder import confined_log

    return confined_log(run, node)


def attempts_kept(ledger: Any, run_id: str, run_dir: Path) -> tuple[int, list[int]]:
    """(the run's last attempt, the earlier attempts whose logs were kept in ``<run>/attempt<N>/``): a run rented
    again after a preemption keeps each ended attempt's node logs there (:mod:`broker.run.attempts`); (1, []) for a
    run of one attempt."""
    try:
        rows = ledger.attempts(run_id)
    except Exception:  # noqa: BLE001 - a ledger without the attempts table: one attempt
        rows = []
    last = max(1, len(rows))
    kept = [n for n in range(1, last) if (run_dir / f"attempt{n}").is_dir()]
    return last, kept


def follow_log(ledger: Any, run_id: str, path: Path, *, out: Any = None, poll_s: float = 0.5,
               timeout_s: float | None = None) -> None:
    """Print ``path`` and, while the run is active (its CLI alive), what is appended to it; returns once the run
    has ended and the rest is printed (or after ``timeout_s``)."""
    from broker.money.accounting import ACTIVE_STATUSES, cli_alive

    out = out or sys.stdout
    pos = 0
    t0 = time.monotonic()
    while True:
        if path.exists():
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
            if data:
                from broker.core.ui import node_text

                out.write(node_text(data.decode("utf-8", errors="replace")))
                out.flush()
                pos += len(data)
        run = ledger.get_run(run_id)
        active = run is not None and run.status in ACTIVE_STATUSES and cli_alive(run.pid, run.pid_start)
        if not active:
            if path.exists() and path.stat().st_size > pos:
                continue  # the last lines written before the end
            return
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            return
        time.sleep(poll_s)


def find_run_or_latest(ledger: Any, run_id: str | None) -> Any:
    """The run ``run_id`` names (an id or unique prefix), or the newest run for ``latest`` / None.  Raises BadInput
    when there is no run yet (or nothing matches)."""
    if run_id in (None, "", "latest"):
        runs = ledger.list_runs(limit=1)
        if not runs:
            from broker.core.provider import BadInput

            raise BadInput("there are no runs yet", hint="`broker run RECIPE` (or `broker run -d RECIPE`) starts one")
        return runs[0]
    return ledger.find_run(run_id)


def _say_final_state(run: Any) -> None:
    """After ``broker logs -f``: the run's state in one line on stderr (the log on stdout stays the node's own);
    the exit status stays 0 (the log was printed), the line says whether the job failed."""
    from rich.markup import escape

    from broker.money.accounting import ACTIVE_STATUSES
    from broker.core.ui import err, node_text

    if run.status in ACTIVE_STATUSES:
        return  # followed until a timeout, or the CLI died: `broker status` settles it
    style = "green" if run.status == "succeeded" else "bold red"
    msg = f": {escape(node_text(run.message))}" if run.message else ""
    err.print(f"run {run.id} [{style}]{run.status}[/]{msg}", highlight=False)


def ssh_argv(cluster: Any, node: int, command: list[str] | None = None) -> list[str]:
    """``ssh`` argv for node ``node`` of a stored cluster: the run's key, its known_hosts (new keys accepted and
    added, changed keys refused), the node's user, host and port."""
    from broker.core.provider import BadInput
    from broker.core.runfolder import USER_RE, valid_host

    n = cluster.nodes[node]
    # the user and host come from a file in the run's folder: checked here too (not only in kept_cluster), and
    # passed as -l USER and after "--", so neither can ever be read as an ssh option
    if not (isinstance(n.user, str) and USER_RE.fullmatch(n.user)) or not valid_host(n.host):
        raise BadInput(f"refused: node {node}'s ssh user {n.user!r} / host {n.host!r} is not a user name / an IP "
                       "address or DNS name", hint="the run's cluster.json was edited; nothing was run")
    argv = ["ssh", "-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=accept-new"]
    if cluster.ssh_key_path:
        argv += ["-i", cluster.ssh_key_path]
    if cluster.known_hosts_path:
        argv += ["-o", f"UserKnownHostsFile={cluster.known_hosts_path}"]
    if getattr(n, "resource_id", None):  # pinned per machine (never the key of an address's last holder)
        argv += ["-o", f"HostKeyAlias={_host_key_alias(n)}"]
    if n.port and n.port != 22:
        argv += ["-p", str(int(n.port))]
    argv += ["-l", n.user, "--", n.host]  # after "--" ssh parses no more options: the command follows as is
    if command:
        argv += list(command)
    return argv


def _host_key_alias(n: Any) -> str:
    """The name node ``n``'s host key is pinned under (its resource id, never its address)."""
    from broker.core.sshkeys import host_key_name

    return host_key_name(n.host, n.port or 22, getattr(n, "resource_id", None))


def looks_like_command(recipe_arg: str) -> bool:
    """``broker exec RUN -- CMD``: the word after RUN is a command, not a recipe, when no such file exists and it
    is not named like a recipe (``*.yaml``/``*.yml``: those get the recipe's own "no such file" error)."""
    return not Path(recipe_arg).exists() and Path(recipe_arg).suffix.lower() not in (".yaml", ".yml")


def exec_command(ledger: Any, run_id: str, command: list[str], *, echo: Any, timeout_s: float = 600.0) -> int:
    """Run ``command`` on every node of the live or kept run ``run_id`` (a ``broker netns up`` cluster, kept
    nodes) over SSH, printing ``[node i] line``; returns the highest exit status (255: a node not reached).
    Raises BadInput when the run has no nodes to reach."""
    import shlex

    from broker.run.kept import kept_cluster
    from broker.run.sshcluster import run_on_every_node

    refuse_stopped(ledger, run_id)
    run, cluster = kept_cluster(ledger, run_id)
    if cluster.local_exec:
        from broker.core.provider import BadInput

        raise BadInput(f"the nodes of run {run.id} are processes on this machine ({cluster.provider}): no SSH",
                       hint=f"their folders are under {run.run_dir}")
    line = command[0] if len(command) == 1 else shlex.join(command)
    return run_on_every_node(cluster, line, run_dir=Path(run.run_dir or "."), echo=echo, timeout_s=timeout_s)


def ssh_config(run_id: str, cluster: Any) -> str:
    """``Host`` entries for ``~/.ssh/config`` (one per node: ``broker-<run>-n<i>``)."""
    out = []
    for n in cluster.nodes:
        if getattr(n, "local", False):  # node 0 of a hybrid run is this machine
            continue
        lines = [f"Host broker-{_ssh_value(run_id)}-n{int(n.node_rank)}", f"  HostName {_ssh_value(n.host)}",
                 f"  User {_ssh_value(n.user)}"]
        if n.port and n.port != 22:
            lines.append(f"  Port {n.port}")
        if cluster.ssh_key_path:
            lines += [f"  IdentityFile {_ssh_word(str(cluster.ssh_key_path))}", "  IdentitiesOnly yes"]
        if cluster.known_hosts_path:
            lines.append(f"  UserKnownHostsFile {_ssh_word(str(cluster.known_hosts_path))}")
        if getattr(n, "resource_id", None):
            lines.append(f"  HostKeyAlias {_host_key_alias(n)}")
        lines.append("  StrictHostKeyChecking accept-new")
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


from broker.core.sshconfig import BEGIN as _BEGIN, END as _END, without_run as _without_run  # noqa: E402


def install_ssh_config(run_id: str, entries: str, *, user_config: Path | None = None,
                       own: Path | None = None) -> tuple[Path, Path, Path | str | None]:
    """Put run ``run_id``'s Host ``entries`` in broker's own ssh config (``<home>/ssh_config``, 0600; an earlier
    block of the same run is replaced) and make ``~/.ssh/config`` (``user_config``) ``Include`` it, at its top (an
    Include after a ``Host`` line would only apply inside that Host).  Idempotent: a second call changes nothing
    in ``~/.ssh/config``.  Returns (broker's file, the user's file, what changed there: the backup's path, ``""``
    when the file was created, None when it already included broker's file)."""
    from broker.core.config import home_path

    own = own or home_path() / "ssh_config"
    user_config = user_config or Path.home() / ".ssh" / "config"
    if user_config.is_symlink():  # a config kept elsewhere (dotfiles): edit the file it points to, keep the link
        user_config = Path(os.path.realpath(user_config))
    old = _without_run(own.read_text(encoding="utf-8") if own.exists() else "", run_id)
    begin, end = _BEGIN.format(run_id), _END.format(run_id)
    text = old.rstrip("\n") + ("\n\n" if old.strip() else "") + f"{begin}\n{entries.rstrip()}\n{end}\n"
    own.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(own.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(own.with_suffix(".tmp"), own)
    include = f"Include {_ssh_word(str(own))}"
    current = user_config.read_text(encoding="utf-8") if user_config.exists() else None
    if current is not None and any(line.strip() == include for line in current.splitlines()):
        return own, user_config, None
    user_config.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    changed: Path | str = ""
    if current is not None:
        changed = user_config.with_name(user_config.name + ".broker-backup")
        fd = os.open(changed, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(current)
    note = "# broker: Host broker-<run>-n<i> entries (`broker ssh RUN --config --install`)"
    new = f"{note}\n{include}\n\n" + (current or "")
    tmp = user_config.with_name(user_config.name + ".broker-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(new)
    if current is not None:
        os.chmod(tmp, user_config.stat().st_mode & 0o777)
    os.replace(tmp, user_config)
    return own, user_config, changed


def _ssh_value(text: Any) -> str:
    """``text`` as a bare ssh config value; BadInput when it holds whitespace, a quote, a control character or
    starts with '-' (a value from a run's files must never add a line or an option to an ssh config)."""
    s = str(text)
    if not s or s.startswith("-") or any(c.isspace() or c in "\"'\\#" or ord(c) < 32 or ord(c) == 127 for c in s):
        from broker.core.provider import BadInput

        raise BadInput(f"refused: {s!r} cannot be an ssh config value (whitespace, quotes, control characters)",
                       hint="the run's cluster.json was edited; nothing was written")
    return s


def _ssh_word(text: str) -> str:
    """``text`` as one word of an ssh config line (double quotes around a path with spaces); BadInput for a
    newline, a quote or a control character (they would end the line or the word)."""
    if any(c in "\"\\" or (ord(c) < 32 and c != " ") or ord(c) == 127 for c in text):
        from broker.core.provider import BadInput

        raise BadInput(f"refused: {text!r} cannot be an ssh config path (quotes or control characters)",
                       hint="the run's cluster.json was edited; nothing was written")
    return f'"{text}"' if any(c.isspace() for c in text) else text


def cost_data(ledger: Any, *, since: datetime | None = None, provider: str | None = None,
              rows: int | None = None, run_id: str | None = None) -> dict[str, Any]:
    """What runs cost per the ledger (USD), summed in SQL: ``by_provider`` over every matching run (``run_count``
    of them), ``runs`` the newest ``rows`` of them (all with None), newest first.  A provider whose money is
    pretend (the fake cloud) is named in ``pretend_providers`` and left out of ``total_usd``.  ``run_id``: that
    run only (its totals are its own)."""
    from broker.core.model import utcnow

    now = utcnow()
    runs = [dict(r, usd=round(r["usd"], 6)) for r in ledger.run_costs(now, since=since, provider=provider,
                                                                        limit=rows, run_id=run_id)]
    if run_id is not None:
        totals: dict = {}
        for r in runs:
            n, usd = totals.get(r["provider"], (0, 0.0))
            totals[r["provider"]] = (n + 1, usd + r["usd"])
    else:
        totals = ledger.cost_totals(now, since=since, provider=provider)
    split = ledger.runs_with_attempts()
    if split:  # a run rented more than once (preempted): its cost per attempt
        from broker.run.attempts import attempt_costs

        for r in runs:
            if r["run"] in split:
                r["attempts"] = [{"attempt": a["attempt"], "cause": a["cause"], "usd": round(a["usd"], 6),
                                  "started_at": a["started_at"].isoformat(),
                                  "ended_at": a["ended_at"].isoformat() if a["ended_at"] else None}
                                 for a in attempt_costs(ledger, r["run"])]
    pretend = sorted((p for p in totals if _pretend_money(p)), key=str)
    return {"since": since.isoformat() if since else None, "provider": provider, "runs": runs,
            "run_count": sum(n for n, _ in totals.values()),
            "by_provider": {p: round(usd, 6) for p, (_n, usd) in totals.items()},
            "pretend_providers": pretend,
            "pretend_run_count": sum(totals[p][0] for p in pretend),
            "pretend_usd": round(sum(totals[p][1] for p in pretend), 6),
            "total_usd": round(sum(usd for p, (_n, usd) in totals.items() if p not in pretend), 6),
            "stopped": [r for r in _stopped_rows(ledger) if run_id is None or r["run"] == run_id]}


def _stopped_rows(ledger: Any) -> list[dict[str, Any]]:
    """Machines ``broker stop`` stopped: run, provider, provider id, what they bill while stopped ($/h, their disk)
    and the deadline at which they are deleted."""
    return [{"run": r.run_id, "provider": r.provider, "provider_id": r.provider_id,
             "usd_per_hour": r.stopped_usd_per_hour or 0.0, "deadline": r.deadline.isoformat() if r.deadline else None}
            for r in ledger.resources(live_only=True) if r.state == "stopped"]


def _pretend_money(provider: str | None) -> bool:
    """Whether ``provider``'s money is pretend (its ``pretend`` capability: the fake cloud); unknown: no."""
    from broker.providers import capability

    return bool(capability(provider or "", "pretend"))


def _dir_size(p: Path) -> int:
    total = 0
    for root, _, files in os.walk(p):
        for f in files:
            try:
                total += (Path(root) / f).lstat().st_size
            except OSError:
                pass
    return total


#: the ledger event ``broker clean`` leaves on a run whose folder it removed (read by logs / ssh)
CLEAN_ACTION = "clean"


def folder_removed(ledger: Any, run: Any) -> str | None:
    """When ``broker clean`` removed ``run``'s folder: one sentence saying so (with the date), else None."""
    if run.run_dir and Path(run.run_dir).exists():
        return None
    ev = [e for e in ledger.events(run.id, limit=1_000_000) if e.get("action") == CLEAN_ACTION]
    if not ev:
        return None
    at = ev[-1].get("at")
    when = f" on {str(at)[:16].replace('T', ' ')}" if at else ""
    return f"the folder of run {run.id} ({run.run_dir}) was removed by `broker clean`{when}: its logs and files are gone"


def run_folder_refusal(run_dir: str | None, runs: Path, run_id: str | None = None) -> str | None:
    """Why ``run_dir`` (a ledger row's, so input) must not be deleted, or None when it resolves to the folder
    ``<real runs>/<run_id>`` (with ``run_id`` None: any folder directly inside the real ``runs``): refused are
    relative paths, ``..`` parts, a symlink, another run's folder, and anything outside ``runs``."""
    if run_id is not None:
        from broker.core.runfolder import run_dir_refusal

        why, real = run_dir_refusal(run_dir, run_id, runs)
        if why is None and real is not None and not real.is_dir():
            return f"{run_dir} is not a folder"
        return why
    if not run_dir:
        return "no folder recorded"
    p = Path(run_dir)
    if not p.is_absolute():
        return f"{run_dir!r} is a relative path"
    if ".." in p.parts:
        return f"{run_dir!r} contains '..'"
    if p.is_symlink():
        return f"{run_dir} is a symbolic link (to {os.readlink(p)})"
    try:
        real, root = p.resolve(strict=True), runs.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        return f"{run_dir} cannot be resolved ({e})"
    if real.parent != root:
        return f"{run_dir} is not inside {root}/"
    if not real.is_dir():
        return f"{run_dir} is not a folder"
    return None


def clean_candidates(ledger: Any, *, older_than_days: float = 0.0) -> tuple[list[tuple[Any, Path, int]],
                                                                          list[tuple[Any, str]]]:
    """What ``broker clean`` would remove: ``[(run, folder, bytes)]`` for ended runs older than ``older_than_days``
    (by end time) whose folder exists, never a run that is active or still has live resources; and
    ``[(run, why)]`` for rows whose ``run_dir`` is refused (:func:`run_folder_refusal`: a ledger row cannot make
    clean delete outside ``<home>/runs/``)."""
    from broker.money.accounting import ENDED_STATUSES
    from broker.core.config import runs_dir
    from broker.core.model import utcnow

    runs = runs_dir()
    cutoff = utcnow() - timedelta(days=older_than_days)
    todo, refused = [], []
    for r in ledger.list_runs(limit=None):
        if r.status not in ENDED_STATUSES or not r.run_dir:
            continue
        if not (Path(r.run_dir).exists() or Path(r.run_dir).is_symlink()):
            continue
        if ledger.resources(r.id, live_only=True):
            continue
        if (r.ended_at or r.created_at) and (r.ended_at or r.created_at) > cutoff:
            continue
        why = run_folder_refusal(r.run_dir, runs, r.id)
        if why:
            refused.append((r, why))
            continue
        # resolved once, here: the removal acts on this real path inside the 0700 home (where no other user can
        # swap a symlink in), never on the row's text again
        real = Path(r.run_dir).resolve(strict=True)
        todo.append((r, real, _dir_size(real)))
    return todo, refused


def remove_run_folders(ledger: Any, todo: list[tuple[Any, Path, int]]) -> tuple[list[str], int]:
    """Remove the folders :func:`clean_candidates` listed (``[(run, resolved folder, bytes)]``), each checked once
    more by :func:`_remove_run_folder`, with a ledger event per run.  Returns (removed run ids, bytes freed)."""
    removed, freed = [], 0
    for r, path, size in todo:
        _remove_run_folder(r, path)  # rmtree never follows symlinks inside the folder
        ledger.event(r.id, "cli", CLEAN_ACTION, f"run folder {path} removed ({size} bytes)")
        removed.append(r.id)
        from broker.core.sshconfig import forget_run_hosts

        forget_run_hosts(r.id)  # its machines are gone: no Host entry keeps naming their addresses
        freed += size
    return removed, freed


def _remove_run_folder(run: Any, real: Path) -> None:
    """Remove ``real`` (the resolved folder :func:`clean_candidates` checked) after checking once more that it is
    still exactly ``<real runs>/<run id>`` and not a symlink; rmtree never follows symlinks inside it."""
    from broker.core.config import runs_dir

    if real != runs_dir().resolve() / run.id or real.is_symlink():
        return
    shutil.rmtree(real, ignore_errors=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _parse_since(value: str | None) -> datetime | None:
    if not value:
        return None
    from broker.core.provider import BadInput

    try:
        d = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(f"--since {value!r} is not a date", hint="use YYYY-MM-DD (or an ISO time)") from None
    return d if d.tzinfo else d.replace(tzinfo=timezone.utc)


def logs_cmd(
    run_id: str = typer.Argument("latest", metavar="[RUN]", help="run id, a unique prefix (see `broker "
                                 "status`) or latest (the default: the newest run)"),
    node: int = typer.Option(0, "--node", "-n", help="which node's log (default 0)"),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing while the run is live"),
    attempt: Optional[int] = typer.Option(None, "--attempt", "-a", min=1, help="which attempt's log, for a run "
                                          "that was preempted and rented again (default: the last)"),
) -> None:
    """Print a run's node log (past or running); -f follows a live run until it ends."""
    from broker.money.ledger import Ledger
    from broker.core.provider import BadInput

    from broker.cli import starting

    ledger = Ledger()
    pend = starting.find(ledger, run_id)
    if pend is not None:  # `broker run -d` whose background process has not written its row yet
        if not pend["alive"]:
            raise starting.not_started(pend)
        if not follow:
            raise BadInput(f"run {pend['run_id']} is still starting in the background (pid {pend['pid']}): no "
                           "log yet", hint=f"`broker logs -f {pend['run_id']}` waits for it")
        run = starting.wait_for_row(ledger, pend)
    else:
        run = find_run_or_latest(ledger, run_id)
    nodes = int((run.recipe or {}).get("nodes") or 1)
    if not 0 <= node < max(nodes, 1):
        raise BadInput(f"run {run.id} has {nodes} node(s): no node {node}", hint=f"--node 0..{nodes - 1}")
    path = _node_log(run, node)
    last, kept = attempts_kept(ledger, run.id, path.parent)
    if attempt is not None and attempt != last:
        if attempt not in kept:
            raise BadInput(f"run {run.id} has no log of attempt {attempt}",
                           hint=f"--attempt 1..{last}" if last > 1 else "it ran once: leave --attempt out")
        path = path.parent / f"attempt{attempt}" / path.name
        if path.is_symlink():
            raise BadInput(f"{path} is a symbolic link: broker reads only its own files there",
                           hint=f"remove it; `broker status {run.id}` still shows each attempt")
        follow = False  # an earlier attempt has ended: its log is whole
    elif kept:  # on stderr: a pipe of the log gets the log only
        sys.stderr.write(f"broker: the log of attempt {last} of {last}; attempt(s) "
                         f"{', '.join(map(str, kept))} ended earlier: `broker logs {run.id} --node {node} "
                         f"--attempt {kept[0]}`\n")
    if follow:
        try:
            follow_log(ledger, run.id, path)
        except KeyboardInterrupt:
            # Ctrl-C stops the following, not the run (it is another process): say so, not "interrupted"
            sys.stderr.write(f"\nbroker: stopped following; run {run.id} goes on (`broker logs -f {run.id}` "
                             f"follows it again, `broker down {run.id}` stops it)\n")
            raise typer.Exit(0) from None
        _say_final_state(ledger.get_run(run.id) or run)
        return
    if not path.exists():
        removed = folder_removed(ledger, run)
        if removed:
            raise BadInput(removed, hint=f"`broker status {run.id}` still shows what the run did and cost")
        raise BadInput(f"run {run.id} has no log for node {node} ({path})",
                       hint="the run may have ended before the node started; `broker status " + run.id + "`")
    from broker.core.ui import node_text

    sys.stdout.write(node_text(path.read_text(encoding="utf-8", errors="replace")))


def ssh_cmd(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="RUN", help="run id or a unique prefix"),
    node_arg: Optional[str] = typer.Argument(None, metavar="[NODE]", help="node index (default 0)"),
    config: bool = typer.Option(False, "--config", help="print Host entries for ~/.ssh/config instead"),
    install: bool = typer.Option(False, "--install", help="with --config: write them to broker's own ssh "
                                 "config and Include it from ~/.ssh/config (once; a backup is kept), so "
                                 "`ssh broker-RUN-n0` works"),
) -> None:
    """A shell (or, after --, one command) on a node of a live or kept run, with the run's key and known_hosts."""
    from broker.money.ledger import Ledger
    from broker.run.kept import kept_cluster
    from broker.core.provider import BadInput

    refuse_stopped(Ledger(), run_id)
    run, cluster = kept_cluster(Ledger(), run_id)
    if cluster.local_exec:
        raise BadInput(f"the nodes of run {run.id} are processes on this machine ({cluster.provider}): no SSH",
                       hint=f"their folders are under {run.run_dir}")
    if install and not config:
        raise BadInput("--install goes with --config", hint=f"broker ssh {run.id} --config --install")
    if config and install:
        from broker.core.ui import console

        own, user, changed = install_ssh_config(run.id, ssh_config(run.id, cluster))
        console.print(f"wrote the Host entries of run {run.id} to {own}", highlight=False)
        console.print((f"added `Include {own}` to {user}" + (f" (backup: {changed})" if changed else ""))
                      if changed is not None else f"{user} already includes it", highlight=False)
        console.print(f"  ssh broker-{run.id}-n0", highlight=False, soft_wrap=True)
        return
    if config:
        sys.stdout.write(ssh_config(run.id, cluster))
        return
    command = [a for a in ctx.args if a != "--"]
    if node_arg is not None and not node_arg.isdigit():  # `broker ssh RUN -- CMD`: no NODE given
        command, node_arg = [node_arg, *command], None
    node = int(node_arg or 0)
    if not 0 <= node < len(cluster.nodes):
        raise BadInput(f"run {run.id} has {len(cluster.nodes)} node(s): no node {node}",
                       hint=f"broker ssh {run.id} 0..{len(cluster.nodes) - 1}")
    if cluster.nodes[node].local:  # node 0 of a hybrid run: this machine
        raise BadInput(f"node {node} of run {run.id} is this machine (hybrid): no SSH needed",
                       hint=f"its folder is {cluster.nodes[node].workroot or run.run_dir}; the VMs are nodes "
                            f"1..{len(cluster.nodes) - 1}")
    argv = ssh_argv(cluster, node, command or None)
    from broker.slurm.cluster import slurm_ssh_argv  # a `broker slurm up` cluster: SLURM_CONF in the session

    argv = slurm_ssh_argv(run, argv, command)
    if shutil.which("ssh") is None:
        raise BadInput("the ssh client is not installed", hint="apt-get install openssh-client")
    if command:
        import subprocess

        raise typer.Exit(subprocess.run(argv).returncode)
    os.execvp("ssh", argv)


def exec_cmd(
    ctx: typer.Context,
    run_id: str = typer.Argument(..., metavar="RUN", help="a run whose nodes were kept (recipe idle_minutes)"),
    recipe_path: Path = typer.Argument(..., metavar="RECIPE", help="the recipe to run on those nodes"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="do not stream node logs"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Run RECIPE on the kept nodes of RUN (recipe idle_minutes), without provisioning; the idle timer restarts.
    On a cluster from `broker slurm up`: `broker exec CLUSTER -- CMD` runs CMD on every node."""
    from broker.money.ledger import Ledger as _Ledger
    from broker.slurm.cluster import exec_on_cluster

    code = exec_on_cluster(_Ledger(), run_id, [str(recipe_path), *[a for a in ctx.args if a != "--"]],
                           echo=lambda line: sys.stdout.write(line + "\n"))
    if code is not None:
        raise typer.Exit(code)
    if looks_like_command(str(recipe_path)):  # `broker exec RUN -- hostname`: on every node
        raise typer.Exit(exec_command(_Ledger(), find_run_or_latest(_Ledger(), run_id).id,
                                      [str(recipe_path), *[a for a in ctx.args if a != "--"]],
                                      echo=lambda line: sys.stdout.write(line + "\n")))
    if [a for a in ctx.args if a != "--"]:
        from broker.core.provider import BadInput

        raise BadInput(f"unexpected argument(s) after {recipe_path}: {' '.join(ctx.args)}",
                       hint="broker exec RUN RECIPE (a command after -- runs only on `broker slurm up` clusters)")
    from broker.cli.run import lint_or_refuse
    from broker.core.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    lint_or_refuse(recipe, as_json=as_json)
    from broker.cli.run import run_on_kept

    raise typer.Exit(run_on_kept(run_id, recipe, quiet=quiet, as_json=as_json))


def cost_cmd(
    run_id: Optional[str] = typer.Argument(None, metavar="[RUN]", help="one run (an id, a unique prefix or "
                                           "latest), with its attempts"),
    since: Optional[str] = typer.Option(None, "--since", help="only runs created on or after this date "
                                        "(YYYY-MM-DD)"),
    provider: Optional[str] = typer.Option(None, "--provider", "-p", help="only runs on this provider"),
    as_json: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """What runs cost (or RUN cost), per run and per provider, from the ledger (USD)."""
    from rich.table import Table

    from broker.money.ledger import Ledger
    from broker.core.ui import console, print_json, usd

    ledger = Ledger()
    one = ledger.find_run(run_id).id if run_id else None  # the id the run's summary names, or a prefix
    data = cost_data(ledger, since=_parse_since(since), provider=provider, rows=None if as_json else 50,
                     run_id=one)
    if as_json:
        print_json(data)
        return
    t = Table(title="cost per run (ledger)", title_justify="left")
    for col in ("run", "provider", "status", "cost"):
        t.add_column(col, justify="right" if col == "cost" else "left")
    from broker.core.prose import usd_parts

    for r in data["runs"][:50]:
        attempts = r.get("attempts", [])
        total, each = usd_parts(r["usd"], [a["usd"] for a in attempts])
        t.add_row(r["run"], r["provider"], r["status"], total)
        for a, cost in zip(attempts, each):
            t.add_row(f"  attempt {a['attempt']}", "", a["cause"] or "running", cost)
    console.print(t)
    if data["run_count"] > 50:
        console.print(f"... {data['run_count'] - 50} older run(s); --json lists all")
    for p, v in sorted(data["by_provider"].items(), key=lambda kv: str(kv[0])):
        pretend = " (pretend money: not billed, not in the total)" if p in data["pretend_providers"] else ""
        console.print(f"{p}: {usd(v)}{pretend}", highlight=False)
    n_pretend = data["pretend_run_count"]
    console.print(f"total: {usd(data['total_usd'])} over {data['run_count'] - n_pretend} run(s)"
                  + (f" (plus {n_pretend} run(s) on {', '.join(map(str, data['pretend_providers']))}: pretend)"
                     if n_pretend else ""), highlight=False)
    for r in data["stopped"]:
        console.print(f"run {r['run']}: {r['provider']} {r['provider_id']} stopped, billing "
                      f"{usd(r['usd_per_hour'])}/h for its disk" + (f" until {r['deadline'][:16]}Z"
                                                                   if r["deadline"] else ""), highlight=False)


def clean_cmd(
    older_than: float = typer.Option(0.0, "--older-than", metavar="DAYS", min=0,
                                     help="only runs that ended at least DAYS days ago"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be removed"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask (needed without a terminal)"),
) -> None:
    """List the folders of ended runs (logs, work copies, checkpoints, artifacts) with their sizes, ask, then
    remove them; never of live runs, never outside <home>/runs/.  Without a terminal it needs --yes."""
    from rich.markup import escape

    from broker.money.ledger import Ledger
    from broker.core.provider import BadInput
    from broker.core.ui import console, err

    ledger = Ledger()
    todo, refused = clean_candidates(ledger, older_than_days=older_than)
    for r, why in refused:
        err.print(f"[bold red]refused[/]: run {r.id}'s folder is not deleted: {escape(why)} (a ledger row's "
                  "run_dir must be a folder inside the broker home's runs/)", highlight=False)
    total = sum(size for _, _, size in todo)
    if not todo:
        console.print("nothing to remove: no ended run has a folder"
                      + (f" older than {older_than:g} day(s)" if older_than else ""), highlight=False)
        return
    console.print(f"{'would remove' if dry_run else 'will remove'} {len(todo)} run folder(s), {_mb(total)}:",
                  highlight=False)
    for r, path, size in todo:
        ended = (r.ended_at or r.created_at)
        console.print(f"  {r.id}  {escape(r.name or '')}  {r.status}"
                      f"{'  ended ' + ended.strftime('%Y-%m-%d') if ended else ''}  {_mb(size):>10}  "
                      f"{escape(str(path))}", highlight=False)
    if dry_run:
        return
    if not yes:
        if not sys.stdin.isatty():
            raise BadInput(f"refusing to remove {len(todo)} run folder(s) ({_mb(total)}) without confirmation",
                           hint="pass --yes to remove them without asking (--dry-run only lists them)")
        if not typer.confirm(f"remove these {len(todo)} run folder(s) ({_mb(total)})?", default=False):
            console.print("nothing removed.")
            raise typer.Exit(1)
    removed, freed = remove_run_folders(ledger, todo)
    console.print(f"removed {len(removed)} run folder(s), {_mb(freed)}", highlight=False)


