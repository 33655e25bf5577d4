"""The Slurm protocol as broker speaks it: job states (:data:`TERMINAL_STATES`, :data:`HOPELESS_REASONS`),
what the cluster says about a job (:class:`JobInfo`), the :class:`Shell` where the client commands run (here or
``ssh host``), and the parsers of ``scontrol show job -o`` / ``ExitCode``.

Under the Slurm adapter (:mod:`broker.providers.slurm`, which re-exports them) and the Slurm cluster commands
(:mod:`broker.slurm.cluster`, :mod:`broker.slurm.submit`), which reach the adapter through the registry.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from broker.core.provider import AuthError, ProviderError, TransientError

if TYPE_CHECKING:
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
