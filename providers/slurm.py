"""A Slurm cluster the user can reach, as a provider: jobs instead of instances.

broker does not schedule anything here; it submits the recipe's batch script (``broker.slurm.executor.render_sbatch``) with
``sbatch --parsable`` and follows the job.  The cluster is reached either directly (the Slurm client commands are
on this machine: a login node, or a cluster in a test) or through SSH to a login node (``host="user@login"``):
every command is then run as ``ssh <host> '<command>'`` and files are read with ``tail -c +N``.  Jobs cost nothing
from broker's point of view (``usd_per_hour`` 0: the cluster's own accounting applies).

Commands used (Slurm 22.05 man pages): ``sbatch --parsable`` (prints ``jobid`` or ``jobid;cluster``), ``squeue -h
-j ID -o %T`` (state while queued or running), ``sacct -j ID -n -P -o JobID,State,ExitCode`` (final state; absent
when the cluster has no accounting storage: "Slurm accounting storage is disabled"), then ``scontrol show job -o
ID`` (``JobState=``, ``ExitCode=code:signal``, ``NodeList=``; kept for ``MinJobAge`` seconds after the end),
``scancel ID``, ``sinfo -h -o %G`` (generic resources: ``(null)`` when a partition has no GPUs).

Errors: a missing client command or SSH failure is a ProviderError naming the call; an unknown job id is not an
error for :meth:`SlurmProvider.terminate` (already gone).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

from broker.core.provider import INSTALL_TAG, RUN_TAG, BadInput, Provider, ProviderCheck, ProviderError
from broker.providers.declared import SLURM

if TYPE_CHECKING:
    from broker.core.records import TaggedResource

# the Slurm protocol (job states, the shell the client commands run in, scontrol's output) is the slurm layer's:
# broker.slurm.cluster and broker.slurm.submit use it too
from broker.slurm.shell import (  # noqa: E402,F401 - re-exported
    _KV, HOPELESS_REASONS, TERMINAL_STATES, JobInfo, Shell, _text, parse_exit_code, parse_scontrol_job)


def cluster_shell(cluster_id: str) -> Shell:
    """The shell on node 0 of the Slurm cluster ``cluster_id`` that ``broker slurm up`` built (its ledger run)."""
    from broker.money.ledger import Ledger
    from broker.slurm.cluster import find, node0_shell

    return node0_shell(find(Ledger(), cluster_id)[1])


class SlurmProvider(Provider):
    """A Slurm cluster reached here or through SSH (``host``).  Resource kind: ``slurm_job`` (id = job id)."""

    name = "slurm"
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = SLURM

    #: broker's jobs carry ``--comment=broker-run=<run id>`` (:meth:`submit`), read back by :meth:`tagged_resource`:
    #: ``down`` / ``reconcile`` / the watchdog scancel only a job whose comment names the row's run
    owner_tags = True
    #: the comment names the run only (no installation tag): the installation is checked when a comment carries one
    install_tags = False
    #: the comment holds the whole run id (never shortened): a comment naming only a prefix of it is not this run's
    cut_run_tags = False
    #: :meth:`tagged_resource` needs the row's attrs (which login host / cluster the job is on)
    tags_need_attrs = True

    @classmethod
    def valid_id(cls, kind: str, provider_id: str) -> bool:
        """A Slurm job id: digits only (what ``sbatch --parsable`` prints)."""
        return isinstance(provider_id, str) and provider_id.isascii() and provider_id.isdigit()

    @classmethod
    def id_form(cls, kind: str) -> str:
        return "digits only"

    def tagged_resource(self, kind: str, provider_id: str, *, region: str | None = None,
                        run_id: str | None = None, attrs: dict[str, Any] | None = None) -> TaggedResource | None:
        """The job's broker tags as Slurm stores them: its comment (``squeue -h -j ID -o %k|%T``), as a
        TaggedResource whose run_id is the ``broker-run=`` value (None for a job without one: not broker's);
        None when the queue does not hold the job (finished or unknown: nothing to cancel).  Raises ProviderError
        when squeue cannot be read."""
        from broker.core.records import TaggedResource

        if kind != "slurm_job" or not self.valid_id(kind, provider_id):
            return None
        cp = self._shell_for(attrs).run(["squeue", "-h", "-j", provider_id, "-o", "%k|%T"], call="squeue")
        out, err = _text(cp.stdout).strip(), _text(cp.stderr).strip()
        if cp.returncode != 0:
            if "invalid job id" in err.lower():
                return None
            raise ProviderError("slurm", "squeue", err or f"exit {cp.returncode}")
        if not out:
            return None
        comment, _, state = out.splitlines()[0].rpartition("|")
        tags = dict(w.split("=", 1) for w in comment.replace(",", " ").split() if "=" in w)
        return TaggedResource(provider=self.name, kind=kind, provider_id=provider_id, run_id=tags.get(RUN_TAG),
                              state=state.strip() or None, installation_id=tags.get(INSTALL_TAG))

    #: the Slurm options of `broker run` (broker.slurm.target.target_for reads them)
    run_options: ClassVar[dict[str, str]] = {
        "--slurm-host": "submit through ssh to this login node",
        "--cluster": "a `broker slurm up` cluster",
    }

    @classmethod
    def run_target(cls, recipe: Any, request: Any, *, say: Any = None) -> Any:
        """:class:`broker.slurm.target.SlurmTarget` with the request's Slurm options over the settings' defaults."""
        from broker.slurm.target import target_for

        return target_for(recipe, request)

    def __init__(self, host: str | None = None, *, ssh: str = "ssh", confirm_s: float = 60.0):
        self.host = host or None
        self.confirm_s = confirm_s
        self.shell = Shell(self.host, ssh=ssh)

    def _shell_for(self, attrs: dict[str, Any] | None) -> Shell:
        host = (attrs or {}).get("host") or None
        if host == self.host:
            return self.shell
        if (attrs or {}).get("cluster"):  # a job on a cluster from `broker slurm up`: through its node 0
            return cluster_shell(str(attrs["cluster"]))  # type: ignore[index]
        return Shell(host, ssh=self.shell.ssh)

    # ---- read side
    def check(self) -> ProviderCheck:
        try:
            out = self.shell.text(["sinfo", "-h", "-o", "%P %a %D %T"], call="sinfo", timeout=20)
        except ProviderError as e:
            return ProviderCheck(provider=self.name, configured=False, usable=False, detail=e.message, hint=e.hint)
        parts = ", ".join(" ".join(line.split()) for line in out.strip().splitlines()) or "no partitions"
        return ProviderCheck(provider=self.name, configured=True, usable=True,
                             detail=f"Slurm {self.shell.where}: {parts}")

    def has_gpus(self, partition: str | None = None) -> bool:
        """True when some node of ``partition`` (default: all) has a ``gpu`` generic resource (``sinfo %G``)."""
        argv = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
        out = self.shell.text(argv, call="sinfo")
        return any(g.startswith("gpu") for line in out.split() for g in line.split(","))

    def partition_nodes(self, partition: str | None = None) -> int | None:
        """Number of nodes in ``partition`` (default: the cluster's default partition, marked ``*`` by sinfo), in
        any state; None when sinfo does not list it."""
        out = self.shell.text(["sinfo", "-h", "-o", "%P %D"], call="sinfo")
        total, seen = 0, False
        for line in out.strip().splitlines():
            name, _, count = line.strip().partition(" ")
            default = name.endswith("*")
            if (partition is None and default) or name.rstrip("*") == partition:
                total += int(count.strip() or 0)
                seen = True
        return total if seen else None

    # ---- jobs
    def submit(self, script_path: str, *, run_id: str | None = None, extra: list[str] = (), args: list[str] = (),
               prefix: list[str] = ()) -> str:
        """``sbatch --parsable [extra] SCRIPT [args]`` (``args``: the script's own arguments; ``prefix``: a command
        in front of sbatch, e.g. ``env PATH=...``); returns the job id.  Raises ProviderError with sbatch's
        message."""
        argv = [*prefix, "sbatch", "--parsable", *extra]
        if run_id:
            argv.append(f"--comment={RUN_TAG}={run_id}")
        cp = self.shell.run(argv + [script_path, *args], call="sbatch")
        out, err = _text(cp.stdout).strip(), _text(cp.stderr).strip()
        if cp.returncode != 0 or not out:
            raise ProviderError("slurm", "sbatch", err or out or f"exit {cp.returncode}",
                                hint="check partition, account, --time and the node/GPU counts against sinfo")
        job_id = out.splitlines()[-1].split(";")[0].strip()
        if not job_id.isdigit():
            raise ProviderError("slurm", "sbatch", f"unexpected output {out!r} (expected a job id)")
        return job_id

    def job(self, job_id: str, *, attrs: dict[str, Any] | None = None) -> JobInfo:
        """The job's state: ``squeue`` while it is queued or running, then ``sacct``, then ``scontrol``."""
        sh = self._shell_for(attrs)
        cp = sh.run(["squeue", "-h", "-j", job_id, "-o", "%T|%R"], call="squeue")
        line = _text(cp.stdout).strip()
        if cp.returncode == 0 and line:
            state, _, reason = line.splitlines()[0].partition("|")
            state = state.strip().upper()
            reason = reason.strip().strip("()")
            if state not in TERMINAL_STATES:
                return JobInfo(job_id, state, reason="" if reason == "None" else reason, source="squeue")
        return self.final(job_id, attrs=attrs)

    def final(self, job_id: str, *, attrs: dict[str, Any] | None = None) -> JobInfo:
        """The state of a job that left the queue: ``sacct`` where accounting exists, else ``scontrol``."""
        sh = self._shell_for(attrs)
        cp = sh.run(["sacct", "-j", job_id, "-n", "-P", "-X", "-o", "JobID,State,ExitCode,NodeList"], call="sacct")
        if cp.returncode == 0:
            for row in _text(cp.stdout).strip().splitlines():
                f = row.split("|")
                if len(f) >= 3 and f[0] == job_id:
                    code, sig = parse_exit_code(f[2])
                    state = f[1].split()[0].upper() if f[1] else "UNKNOWN"  # "CANCELLED by 0"
                    nodes = self._hostnames(sh, f[3]) if len(f) > 3 and f[3] else []
                    return JobInfo(job_id, state, code, sig, nodes, source="sacct")
        cp = sh.run(["scontrol", "show", "job", "-o", job_id], call="scontrol")
        if cp.returncode != 0 or not _text(cp.stdout).strip():
            return JobInfo(job_id, "UNKNOWN", reason=_text(cp.stderr).strip(), source="scontrol")
        kv = parse_scontrol_job(_text(cp.stdout))
        code, sig = parse_exit_code(kv.get("ExitCode", ""))
        state = kv.get("JobState", "UNKNOWN").upper()
        nodes = self._hostnames(sh, kv["NodeList"]) if kv.get("NodeList") not in (None, "", "(null)") else []
        return JobInfo(job_id, state, code if state in TERMINAL_STATES else None, sig, nodes,
                       reason=kv.get("Reason", ""), source="scontrol")

    @staticmethod
    def _hostnames(sh: Shell, nodelist: str) -> list[str]:
        cp = sh.run(["scontrol", "show", "hostnames", nodelist], call="scontrol")
        return _text(cp.stdout).split() if cp.returncode == 0 else []

    def cancel(self, job_id: str, *, attrs: dict[str, Any] | None = None) -> None:
        """``scancel`` the job (an already finished or unknown job is fine)."""
        cp = self._shell_for(attrs).run(["scancel", job_id], call="scancel")
        err = _text(cp.stderr).strip()
        if cp.returncode != 0 and "Invalid job id" not in err and "already completing" not in err.lower():
            raise ProviderError("slurm", "scancel", err or f"exit {cp.returncode}")

    # ---- lifecycle contract
    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """``slurm_job``: scancel, then wait up to ``confirm_s`` (60 s) for a final state (``CANCELLED``; a job
        passes through ``COMPLETING`` while its steps are killed).  True once final or unknown to Slurm."""
        if kind != "slurm_job":
            raise BadInput(f"the slurm provider has no {kind!r} resources", hint="only slurm_job")
        info = self.job(provider_id, attrs=attrs)
        if info.done:
            return True
        self.cancel(provider_id, attrs=attrs)
        stop_by = time.monotonic() + self.confirm_s
        while not (info := self.job(provider_id, attrs=attrs)).done and time.monotonic() < stop_by:
            time.sleep(0.5)
        return info.done

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """Queued or running jobs submitted by broker (``--comment=broker-run=<run id>``).

        Jobs on clusters ``broker slurm up`` built (ledger rows with ``attrs.cluster``) are asked of that
        cluster's own controller through its node 0; a cluster that is no longer up holds no jobs (its nodes are
        gone).  This provider's own Slurm (here or ``host``) is asked only when it has a host or the ledger holds a
        job that is not on such a cluster: on a machine without a controller, squeue only prints errors.  Raises
        ProviderError when a Slurm that should answer does not."""
        local, clusters = self._where_jobs_are(run_id)
        found: list[TaggedResource] = []
        for cid in clusters:
            sh = self._cluster_shell_if_up(cid)
            if sh is not None:
                found += self._tagged_on(sh, run_id)
        if local:
            found += self._tagged_on(self.shell, run_id)
        return found

    def _where_jobs_are(self, run_id: str | None) -> tuple[bool, list[str]]:
        """(ask this provider's own Slurm, the ``broker slurm up`` clusters whose jobs the ledger records)."""
        if self.host:
            return True, []
        try:
            from broker.money.ledger import Ledger

            rows = [r for r in Ledger().resources(run_id) if r.provider == self.name and r.kind == "slurm_job"]
        except Exception:  # noqa: BLE001 - no ledger to read: the plain behaviour, this machine's Slurm
            return True, []
        clusters = list(dict.fromkeys(str(r.attrs["cluster"]) for r in rows if (r.attrs or {}).get("cluster")))
        local = any(not (r.attrs or {}).get("cluster") for r in rows) or not rows
        return local, clusters

    @staticmethod
    def _cluster_shell_if_up(cluster_id: str) -> Shell | None:
        from broker.money.accounting import ACTIVE_STATUSES
        from broker.money.ledger import Ledger
        from broker.slurm.cluster import find, node0_shell

        try:
            run, state = find(Ledger(), cluster_id)
        except BadInput:
            return None  # no such cluster (any more): nothing of it can hold a job
        return node0_shell(state) if run.status in ACTIVE_STATUSES else None

    def _tagged_on(self, sh: Shell, run_id: str | None) -> list[TaggedResource]:
        from broker.core.records import TaggedResource

        out = sh.text(["squeue", "-h", "-o", "%i|%k|%T|%j"], call="squeue")
        found = []
        for row in out.strip().splitlines():
            jid, comment, state, name = (row.split("|") + ["", "", ""])[:4]
            if not comment.startswith(f"{RUN_TAG}="):
                continue
            rid = comment.split("=", 1)[1]
            if run_id is None or rid == run_id:
                found.append(TaggedResource(provider=self.name, kind="slurm_job", provider_id=jid.strip(),
                                            run_id=rid, state=state, usd_per_hour=0.0, name=name))
        return found
