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

import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.core.provider import (INSTALL_TAG, RUN_TAG, AuthError, BadInput, Provider, ProviderCheck, ProviderError,
                             TransientError)

if TYPE_CHECKING:
    from broker.core.records import TaggedResource
    from broker.run.staging import StagedTar

#: job states after which nothing more happens (squeue/sacct/scontrol spelling)
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}


#: pending reasons (squeue %R) after which Slurm will never start the job as submitted (squeue(1) "JOB REASON
#: CODES"; PartitionConfig is what 22.05 shows for more nodes than the partition has)
HOPELESS_REASONS = ("PartitionConfig", "PartitionTimeLimit", "BadConstraints", "InvalidAccount", "InvalidQOS",
                    "DependencyNeverSatisfied", "AccountNotAllowed", "QOSMaxNodePerJobLimit",
                    "QOSMaxWallDurationPerJobLimit", "QOSMaxCpuPerJobLimit", "QOSMaxGRESPerJob",
                    # the batch step could not start on its node (e.g. slurmstepd's socket path too long): Slurm
                    # requeues the job and holds it for an administrator, so it never runs by itself
                    "launch failed requeued held")


@dataclass
class JobInfo:
    """What the cluster says about one job.  ``state`` in Slurm's words (``UNKNOWN`` when it no longer knows the
    job); ``exit_code`` / ``signal`` from ``ExitCode=code:signal`` (None while running); ``source`` names the
    command that answered."""

    job_id: str
    state: str
    exit_code: int | None = None
    signal: int | None = None
    nodes: list[str] = field(default_factory=list)
    reason: str = ""
    source: str = ""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES or self.state == "UNKNOWN"

    @property
    def hopeless(self) -> bool:
        """Pending for a reason that will not go away by waiting (see HOPELESS_REASONS)."""
        return self.state == "PENDING" and self.reason in HOPELESS_REASONS


class Shell:
    """Runs commands where the Slurm client commands are: here (``host=None``) or ``ssh host``."""

    def __init__(self, host: str | None = None, *, ssh: str = "ssh"):
        self.host = host
        self.ssh = ssh

    @property
    def where(self) -> str:
        return f"on {self.host} (ssh)" if self.host else "on this machine"

    def argv(self, argv: list[str]) -> list[str]:
        if self.host is None:
            return argv
        # one shared connection for the many short commands of a run (ControlMaster; it lingers 60 s after); its
        # socket in this user's 0700 runtime folder, never shared /tmp (a socket another user bound first there
        # would answer our commands and receive the batch script)
        from broker.core.private import control_path

        # the host may come from a ledger row's attrs (`down` of a run on a login node): checked, and after "--"
        # so that it can never be read as an ssh option
        user, _, host = self.host.rpartition("@")
        from broker.core.runfolder import USER_RE, valid_host

        if (user and not USER_RE.fullmatch(user)) or not valid_host(host):
            raise ProviderError("slurm", "ssh", f"{self.host!r} is not a [user@]host (an IP address or DNS name): "
                                "refused, nothing was run",
                                hint="give --host as user@host; a ledger row naming another host was edited")
        return [self.ssh, "-o", "BatchMode=yes", "-o", "ConnectTimeout=15", "-o", "ControlMaster=auto",
                "-o", f"ControlPath={control_path('ssh')}", "-o", "ControlPersist=60", "--", self.host,
                shlex.join(argv)]

    def run(self, argv: list[str], *, input: bytes | str | None = None, timeout: float = 60.0,
            call: str | None = None, stdin: Any = None) -> subprocess.CompletedProcess:
        """Run ``argv`` and return the completed process (never raises for a non-zero exit).  ``stdin``: an open
        file to read from instead of ``input``.

        Raises ProviderError when the command (or ssh) cannot be started, TransientError on timeout, AuthError
        when ssh itself fails (exit 255).
        """
        call = call or argv[0]
        if self.host is None and shutil.which(argv[0]) is None:
            raise ProviderError("slurm", call, f"{argv[0]} is not installed on this machine",
                                hint="run broker on a Slurm login node, or pass --slurm-host user@login")
        try:
            cp = subprocess.run(self.argv(argv), input=input.encode() if isinstance(input, str) else input,
                                capture_output=True, timeout=timeout, **({"stdin": stdin} if stdin else {}))
        except FileNotFoundError as e:
            raise ProviderError("slurm", call, f"cannot start {e.filename}",
                                hint="install the Slurm client commands or OpenSSH") from None
        except subprocess.TimeoutExpired:
            raise TransientError("slurm", call, f"no answer {self.where} within {timeout:.0f} s",
                                 hint="check that slurmctld is up (sinfo) and try again") from None
        if self.host is not None and cp.returncode == 255:
            raise AuthError("slurm", call, f"ssh to {self.host} failed: {_text(cp.stderr).strip()[-300:]}",
                            hint="check that 'ssh <host> true' works without a password (keys, known_hosts)")
        return cp

    def text(self, argv: list[str], *, call: str | None = None, timeout: float = 60.0) -> str:
        """stdout of ``argv``; raises ProviderError with stderr when it exits non-zero."""
        cp = self.run(argv, call=call, timeout=timeout)
        if cp.returncode != 0:
            err = _text(cp.stderr).strip()
            hint = None
            if "configuration source" in err or "slurm.conf" in err or "Unable to contact slurm controller" in err:
                hint = (f"no Slurm cluster is reachable {self.where} (no slurm.conf / controller): run broker on a "
                        "login node, point SLURM_CONF at the cluster's slurm.conf, or pass --slurm-host user@login")
            raise ProviderError("slurm", call or argv[0], f"exit {cp.returncode} {self.where}: "
                                f"{err[-500:] or _text(cp.stdout).strip()[-500:]}", hint=hint)
        return _text(cp.stdout)

    # ---- files on the cluster's shared file system
    def mkdir(self, path: str) -> None:
        if self.host is None:
            Path(path).mkdir(parents=True, exist_ok=True)
        else:
            self.text(["mkdir", "-p", path], call="mkdir")

    def write(self, path: str, data: str) -> None:
        # 0600 from its creation: the batch script carries the recipe's env and secrets
        if self.host is None:
            from broker.core.private import write_private

            write_private(path, data)
        else:
            cp = self.run(["sh", "-c", f"umask 077; rm -f {shlex.quote(path)}; cat > {shlex.quote(path)}"],
                          input=data, call="write")
            if cp.returncode != 0:
                raise ProviderError("slurm", "write", f"cannot write {path} on {self.host}: "
                                    f"{_text(cp.stderr).strip()}")

    def read_from(self, path: str, offset: int) -> bytes:
        """Bytes of ``path`` from ``offset`` on (b"" when the file does not exist yet)."""
        if self.host is None:
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    return f.read()
            except FileNotFoundError:
                return b""
        cp = self.run(["tail", "-c", f"+{offset + 1}", path], call="tail", timeout=30)
        return cp.stdout if cp.returncode == 0 else b""

    def put_dir(self, src: Path, dst: str) -> None:
        """Copy the folder ``src`` to ``dst`` on the cluster (``__pycache__`` and ``.git`` left out)."""
        if self.host is None:
            if Path(dst).exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
            return
        self.mkdir(dst)
        tar = subprocess.run(["tar", "-C", str(src), "--exclude=__pycache__", "--exclude=.git", "-czf", "-", "."],
                             capture_output=True, check=True)
        cp = self.run(["tar", "-C", dst, "-xzf", "-"], input=tar.stdout, call="upload", timeout=600)
        if cp.returncode != 0:
            raise ProviderError("slurm", "upload", f"cannot unpack the workdir into {dst} on {self.host}: "
                                f"{_text(cp.stderr).strip()}")

    def put_tgz(self, data: "bytes | StagedTar", dst: str) -> None:
        """Unpack ``data`` into ``dst`` on the cluster (replaced): tar.gz bytes, or a
        :class:`broker.run.staging.StagedTar` file, read from disk as it is unpacked (memory stays flat)."""
        staged = not isinstance(data, (bytes, bytearray))
        if self.host is None:
            import io
            import tarfile

            if Path(dst).exists():
                shutil.rmtree(dst)
            Path(dst).mkdir(parents=True)
            with (tarfile.open(data.path, mode="r:*") if staged else
                  tarfile.open(fileobj=io.BytesIO(data), mode="r:gz")) as tar:
                tar.extractall(dst, filter="data")
            return
        flags = data.tar_flags if staged else "-xzf"
        argv = ["sh", "-c", f"rm -rf {shlex.quote(dst)} && mkdir -p {shlex.quote(dst)} && "
                            f"tar -C {shlex.quote(dst)} {flags} -"]
        if staged:
            with open(data.path, "rb") as f:
                cp = self.run(argv, stdin=f, call="upload", timeout=600)
        else:
            cp = self.run(argv, input=data, call="upload", timeout=600)
        if cp.returncode != 0:
            raise ProviderError("slurm", "upload", f"cannot unpack the workdir into {dst} on {self.host}: "
                                f"{_text(cp.stderr).strip()}")

    def home(self) -> str:
        """The login user's home directory (absolute)."""
        if self.host is None:
            return str(Path.home())
        return self.text(["sh", "-c", "cd && pwd"], call="home").strip()


def cluster_shell(cluster_id: str) -> Shell:
    """The shell on node 0 of the Slurm cluster ``cluster_id`` that ``broker slurm up`` built (its ledger run)."""
    from broker.money.ledger import Ledger
    from broker.slurm.cluster import find, node0_shell

    return node0_shell(find(Ledger(), cluster_id)[1])


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode("utf-8", errors="replace")


_KV = re.compile(r"(\w+)=(\S*)")


def parse_scontrol_job(line: str) -> dict[str, str]:
    """``scontrol show job -o`` output (one line of ``Key=Value`` pairs) as a dict."""
    return dict(_KV.findall(line))


def parse_exit_code(value: str) -> tuple[int | None, int | None]:
    """Slurm's ``ExitCode`` ``"code:signal"`` -> (code, signal)."""
    m = re.fullmatch(r"(\d+):(\d+)", value.strip())
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


class SlurmProvider(Provider):
    """A Slurm cluster reached here or through SSH (``host``).  Resource kind: ``slurm_job`` (id = job id)."""

    name = "slurm"
    # capabilities (broker.core.provider.Provider documents each; the registry line in providers/__init__.py repeats them)
    topologies = ("slurm",)
    rents = False  # the cluster's owner bills, not broker
    pretend = False
    planned_by_default = False
    quota = False
    quota_unit = None
    quota_scope = None
    node_switch = None
    node_switch_requires = None
    setup_allowance_s = 0
    ssh_ready_timeout_s = 120.0
    create_settle_s = 20.0
    credentials_hint = None
    native_query = False
    live_offer_search = False
    live_price_list = None
    snapshot = None
    local_exec = False
    ingress_rule_format = None

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
