"""SSH to a run's nodes: :class:`SSHCluster` (one asyncssh connection per node on a private event-loop thread,
:class:`LoopThread`; commands, SFTP, host keys pinned per machine) and :class:`RemoteNode`, a node's remote process as
the :class:`broker.run.supervisor.NodeHandle` the supervisor watches.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import shlex
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from broker.run.supervisor import STOP_GRACE_S
from broker.core.records import Cluster
from broker.core.provider import ProviderError
from broker.core.sshkeys import host_key_name, pin_host_key, pinned_keys

_log = logging.getLogger(__name__)


if TYPE_CHECKING:
    from broker.run.staging import StagedTar


#: keepalive interval (s) x count: how long a silently dead connection takes to be declared lost
KEEPALIVE_S, KEEPALIVE_COUNT = 5, 3
#: seconds between a node's exit status and its output's end after which the node counts as ended anyway
EXIT_DRAIN_S = 2.0

Echo = Callable[[str], None] | None


# --------------------------------------------------------------------------------------------------- as root
def needs_sudo(node: Any) -> bool:
    """Whether commands that need root on ``node`` (a ``ClusterNode`` or anything with ``user`` and ``local``) go
    through ``sudo -n``: a rented VM's login user is the image's (``opc``, ``ubuntu``, ...), not root.  This
    machine's own node (``local``) runs as broker does."""
    return not getattr(node, "local", False) and getattr(node, "user", "root") != "root"


def root_prefix(node: Any) -> str:
    """``sudo -n `` (never prompts: a password request fails at once) in front of one command that needs root on
    ``node``, else nothing."""
    return "sudo -n " if needs_sudo(node) else ""


def as_root(script: str, node: Any) -> str:
    """The shell ``script`` (any number of lines) run as root on ``node``: as is for a root login, else through
    ``sudo -n sh -c``."""
    return f"sudo -n sh -c {shlex.quote(script)}" if needs_sudo(node) else script


#: run first on a node whose login is not root: prints why sudo cannot be used without a password
SUDO_CHECK = "sudo -n true 2>&1 || { echo \"(sudo -n exit $?)\"; exit 1; }"


async def arequire_root(ssh: "SSHCluster", i: int, service: str) -> None:
    """ProviderError(``service``) unless node ``i``'s login is root or has passwordless sudo (checked with
    :data:`SUDO_CHECK`); the message names the user, the node and what sudo said."""
    node = ssh.cluster.nodes[i]
    if not needs_sudo(node):
        return
    code, out = await ssh.arun(i, SUDO_CHECK, timeout=30)
    if code != 0:
        said = (out.strip().splitlines() or ["no output"])[0][:200]
        raise ProviderError(service, "sudo -n true", f"the login user {node.user} on node{i} needs passwordless "
                            f"sudo: {said}", hint=f"give {node.user} NOPASSWD sudo on the node (cloud images' "
                            "login users have it: /etc/sudoers.d), or use an image whose login user has it")


class LoopThread:
    """An asyncio event loop running in a daemon thread; :meth:`call` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="broker-ssh", daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout: float | None = None) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.call(_cancel_all(), timeout=10)
        except Exception:  # pragma: no cover - best effort
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class HostKeyChanged(ProviderError):
    """The machine answered with a host key other than the one pinned for it (same resource id): never retried,
    nothing is sent to it."""


def encryption_preference() -> list[str]:
    """The ciphers offered to a node, AES-GCM first, then asyncssh's own defaults (the node's sshd picks the first
    it supports).  asyncssh's chacha20-poly1305, its first choice, builds cipher objects for every packet: 38 us a
    packet against 3.3 us for aes128-gcm (measured here, asyncssh 2.x with cryptography's AES-NI), CPU the log
    stream and the uploads take from the ranks starting beside them.  Both are AEAD ciphers that OpenSSH offers
    by default."""
    from asyncssh.encryption import get_default_encryption_algs

    first = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com"]
    rest = [a.decode() for a in get_default_encryption_algs()]
    return [a for a in first if a in rest] + [a for a in rest if a not in first]


class SSHCluster:
    """One asyncssh connection per node of ``cluster``, on a background event loop.

    Paths on node ``i``: :meth:`base` = ``<workroot>/<run_id>/node<i>``, with ``work/``, ``probe.py``,
    ``env.sh``, ``torchrun.pid`` inside.  Raises ProviderError("ssh", ...) when a node cannot be reached.
    """

    def __init__(self, cluster: Cluster, *, run_dir: Path, connect_timeout_s: float = 20.0):
        self.cluster = cluster
        self.run_dir = Path(run_dir)
        self.connect_timeout_s = connect_timeout_s
        self.loop = LoopThread()
        self._conns: dict[int, Any] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        kh = cluster.known_hosts_path
        self.known_hosts = Path(kh) if kh else self.run_dir / "known_hosts"

    # ------------------------------------------------------------------ paths
    def base(self, i: int) -> str:
        return node_base(self.cluster, i)

    def work(self, i: int) -> str:
        return f"{self.base(i)}/work"

    def probe(self, i: int) -> str:
        return f"{self.base(i)}/probe.py"

    def py(self, i: int | None = None) -> str:
        """The training interpreter (quoted) on node ``i`` (its own where set, else the cluster's)."""
        return shlex.quote(node_python(self.cluster, i))

    def root(self, i: int) -> str:
        """Node ``i``'s workroot (its own where set, else the cluster's)."""
        return node_root(self.cluster, i)

    # ------------------------------------------------------------------ connections
    async def _connect(self, i: int) -> Any:
        import asyncssh

        node = self.cluster.nodes[i]
        if node.local:  # this machine (a hybrid run's node 0): local processes, no SSH
            from broker.run.localconn import LocalConnection

            return LocalConnection()
        name = host_key_name(node.host, node.port, node.resource_id)
        keys = pinned_keys(self.known_hosts, name)
        trusted = [asyncssh.import_public_key(k) for k in keys]
        # the keys pinned for this machine (by resource id: a re-rented machine on a freed address is a new
        # machine), never those of whatever held the address before; none pinned yet: accept-new
        opts: dict[str, Any] = dict(port=node.port, username=node.user, connect_timeout=self.connect_timeout_s,
                                    keepalive_interval=KEEPALIVE_S, keepalive_count_max=KEEPALIVE_COUNT,
                                    known_hosts=(trusted, [], []) if trusted else None,
                                    encryption_algs=encryption_preference())
        if self.cluster.ssh_key_path:
            opts["client_keys"] = [self.cluster.ssh_key_path]
            opts["agent_path"] = None
        _log.info("ssh: connecting to node %d at %s@%s:%s (host key %s)", i, node.user, node.host, node.port,
                  f"pinned as {name}" if trusted else f"new, to be pinned as {name}")
        try:
            conn = await asyncssh.connect(node.host, **opts)
        except asyncssh.HostKeyNotVerifiable:
            machine = f"machine {node.resource_id}" if node.resource_id else "the machine"
            _log.info("ssh: node %d presented a changed host key", i)
            raise HostKeyChanged(
                "ssh", f"connect node {i}",
                f"node {i} at {node.host}:{node.port} ({machine}) presented a host key other than the one broker "
                f"pinned when it first reached this machine ({self.known_hosts}, entry {name}): possibly a "
                "man-in-the-middle, or the machine was rebuilt; nothing was sent to it",
                hint="if you rebuilt or reinstalled the machine yourself, delete that entry and retry; otherwise "
                     f"treat the address as hostile and end the run (`broker down {self.cluster.run_id}`)") from None
        except (OSError, ValueError, asyncssh.Error, asyncio.TimeoutError) as e:  # ValueError: bad key file
            why = getattr(e, "reason", None) or str(e) or type(e).__name__
            _log.info("ssh: node %d not reachable: %s", i, why)
            raise ProviderError("ssh", f"connect node {i}", f"cannot reach node {i} at {node.user}@{node.host}:"
                                f"{node.port}: {why}",
                                hint="check that the node is running, its SSH port is open to you, and the key "
                                     "is authorised") from None
        if not trusted:  # accept-new: pin the key under this machine's name so later connections check it
            key = conn.get_server_host_key()
            if key is not None:
                pin_host_key(self.known_hosts, name, key.export_public_key("openssh").decode())
        return conn

    async def aconn(self, i: int) -> Any:
        """The open connection to node ``i`` (reconnects when it was closed or lost)."""
        lock = self._locks.setdefault(i, asyncio.Lock())
        async with lock:
            conn = self._conns.get(i)
            if conn is not None and not conn.is_closed():
                return conn
            conn = await self._connect(i)
            self._conns[i] = conn
            return conn

    def open(self) -> None:
        """Connect to every node in parallel; raises ProviderError naming the first unreachable node."""
        async def _all() -> None:
            res = await asyncio.gather(*(self.aconn(i) for i in range(len(self.cluster.nodes))),
                                       return_exceptions=True)
            for r in sorted((r for r in res if isinstance(r, BaseException)),
                            key=lambda r: not isinstance(r, HostKeyChanged)):  # a changed key is said first
                raise r
        self.loop.call(_all(), timeout=self.connect_timeout_s + 15)

    def close(self) -> None:
        async def _close() -> None:
            for c in list(self._conns.values()):
                c.close()
            for c in list(self._conns.values()):
                try:
                    await asyncio.wait_for(c.wait_closed(), 5)
                except Exception:  # pragma: no cover
                    pass
        try:
            self.loop.call(_close(), timeout=15)
        except Exception:  # pragma: no cover
            pass
        self.loop.close()

    # ------------------------------------------------------------------ commands and files
    async def arun(self, i: int, cmd: str, *, timeout: float = 60.0,
                   input: str | None = None) -> tuple[int | None, str]:
        """Run ``cmd`` (a shell line) on node ``i`` with ``input`` on its stdin (text; a secret goes this way, never
        on the command line); returns (exit status or None, stdout+stderr)."""
        import asyncssh

        conn = await self.aconn(i)
        _log.debug("ssh node %d: %s", i, cmd)
        try:
            r = await conn.run(cmd, check=False, timeout=timeout, stderr=asyncssh.STDOUT, input=input)
        except asyncssh.TimeoutError as e:
            _log.debug("ssh node %d: timed out after %.0f s", i, timeout)
            return None, f"timed out after {timeout:.0f} s: {(e.stdout or '')[-500:]}"
        _log.debug("ssh node %d: exit %s", i, r.returncode)
        return r.returncode, str(r.stdout or "")

    def run(self, i: int, cmd: str, *, timeout: float = 60.0) -> tuple[int | None, str]:
        return self.loop.call(self.arun(i, cmd, timeout=timeout), timeout=timeout + 15)

    async def aput_bytes(self, i: int, data: bytes, remote: str, mode: int = 0o644) -> None:
        """Write ``data`` to ``remote`` on node ``i``, the file created with ``mode`` (SFTP open attributes; an
        earlier file there is removed first so it cannot keep a wider mode): a secret file (0600) is never
        readable by another user of the node, not even between the write and a chmod."""
        await self.aput_files(i, [(data, remote, mode)])

    async def aput_files(self, i: int, files: "list[tuple[bytes, str, int]]") -> None:
        """Write each ``(data, remote path, mode)`` of ``files`` on node ``i`` as :meth:`aput_bytes` does, in one
        SFTP session (the node's sshd starts an sftp-server per session: about 20 ms each)."""
        import asyncssh

        conn = await self.aconn(i)
        async with conn.start_sftp_client() as sftp:
            made: set[str] = set()
            for data, remote, mode in files:
                parent = str(Path(remote).parent)
                if parent not in made:
                    await sftp.makedirs(parent, exist_ok=True)
                    made.add(parent)
                try:
                    await sftp.remove(remote)
                except asyncssh.SFTPError:
                    pass  # not there yet
                async with sftp.open(remote, "wb", attrs=asyncssh.SFTPAttrs(permissions=mode)) as f:
                    await f.write(data)

    async def aupload_tgz(self, i: int, data: "bytes | StagedTar", remote: str) -> None:
        """Unpack the tar.gz ``data`` (bytes) or the :class:`broker.run.staging.StagedTar` file (streamed from disk:
        memory stays flat whatever its size) into ``remote`` (replaced) on node ``i``, uploaded over SFTP."""
        if isinstance(data, (bytes, bytearray)):
            tgz, flags = f"{remote}.tar.gz", "-xzf"
            await self.aput_bytes(i, data, tgz, 0o600)
        else:
            tgz, flags = f"{remote}.{data.path.name}", data.tar_flags
            conn = await self.aconn(i)
            async with conn.start_sftp_client() as sftp:
                await sftp.makedirs(str(Path(tgz).parent), exist_ok=True)
                await sftp.put(str(data.path), tgz)
                await sftp.chmod(tgz, 0o600)
        q = shlex.quote
        code, out = await self.arun(i, f"rm -rf {q(remote)} && mkdir -p {q(remote)} && "
                                       f"tar {flags} {q(tgz)} -C {q(remote)} && rm -f {q(tgz)}", timeout=600)
        if code != 0:
            raise ProviderError("ssh", f"upload to node {i}", f"unpacking the work folder failed: {out.strip()[-300:]}",
                                hint="check free disk space and that tar exists on the node")

    async def aget(self, i: int, remote: str, local: Path) -> bool:
        """Fetch one file; False when it does not exist on the node."""
        import asyncssh

        conn = await self.aconn(i)
        local.parent.mkdir(parents=True, exist_ok=True)
        async with conn.start_sftp_client() as sftp:
            try:
                await sftp.get(remote, str(local))
            except asyncssh.SFTPNoSuchFile:
                return False
        return True

    def gather(self, coros: Iterable[Any], timeout: float) -> list[Any]:
        """Run coroutines concurrently on the loop; returns results or exceptions, in order."""
        async def _g() -> list[Any]:
            return await asyncio.gather(*coros, return_exceptions=True)
        return self.loop.call(_g(), timeout=timeout)


def run_on_every_node(cluster: Cluster, line: str, *, run_dir: Path, echo: Callable[[str], None],
                      timeout_s: float = 600.0) -> int:
    """Run the shell ``line`` on every node of ``cluster`` at once over SSH (:meth:`SSHCluster.gather`), then print
    each node's output as ``[node i] line`` through ``echo``, node by node, with ``[node i] exit N`` after a non-zero
    status and ``[node i] cannot run it: why`` for a node not reached.  ``timeout_s``: seconds each node's command
    may run.  Returns the highest exit status (255, OpenSSH's convention: a node not reached, or one whose command
    was still running after ``timeout_s``)."""
    ssh = SSHCluster(cluster, run_dir=run_dir, connect_timeout_s=15)
    worst = 0
    try:
        outs = ssh.gather([ssh.arun(i, line, timeout=timeout_s) for i in range(len(cluster.nodes))],
                          timeout=timeout_s + 30)
        for i, r in enumerate(outs):
            if isinstance(r, BaseException):
                echo(f"[node {i}] cannot run it: {getattr(r, 'message', None) or r}")
                worst = max(worst, 255)
                continue
            code, out = r
            for ln in out.splitlines():
                echo(f"[node {i}] {ln}")
            if code is None:  # no exit status: the command outlived timeout_s (its output says so)
                echo(f"[node {i}] no exit status after {timeout_s:g} s")
                code = 255
            elif code:
                echo(f"[node {i}] exit {code}")
            worst = max(worst, code)
    finally:
        ssh.close()
    return worst


class RemoteNode:
    """A torchrun running on a node over SSH; implements :class:`broker.run.supervisor.NodeHandle`.

    ``poll()`` returns the remote exit status; a dropped connection gives 255 (OpenSSH's convention) and sets
    ``lost``.
    """

    def __init__(self, ssh: SSHCluster, node_rank: int, command: str):
        self.ssh = ssh
        self.node_rank = node_rank
        self.command = command
        self.lost = False
        self._q: queue.Queue[bytes | None] = queue.Queue()
        self._code: int | None = None
        self._done = threading.Event()
        self._proc: Any = None
        self._exited_at: float | None = None
        ssh.loop.call(self._start(), timeout=ssh.connect_timeout_s + 15)

    async def _start(self) -> None:
        import asyncssh

        conn = await self.ssh.aconn(self.node_rank)
        _log.debug("ssh node %d: start %s", self.node_rank, self.command)
        # raw bytes (encoding None): the node log keeps exactly what the node printed
        self._proc = await conn.create_process(self.command, stderr=asyncssh.STDOUT, encoding=None)
        asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        from broker.run.supervisor import BATCH_S, READ_CHUNK, SMALL_READ

        code: int | None = None
        try:
            while True:  # blocks of output, not lines: one queue hand-over per block (see broker.run.launch)
                data = await self._proc.stdout.read(READ_CHUNK)
                if not data:
                    break
                self._q.put(data)
                if len(data) < SMALL_READ:
                    await asyncio.sleep(BATCH_S)  # the SSH channel's window holds what arrives meanwhile
            await self._proc.wait()
            code = self._proc.returncode
        except Exception as e:  # connection errors surface here
            self._q.put(f"broker: reading node {self.node_rank}'s output failed: {e}\n".encode())
            code = None
        finally:
            if code is None:
                self.lost = True
                self._q.put(f"broker: ssh connection to node {self.node_rank} lost\n".encode())
                code = 255
            self._code = code
            self._done.set()
            self._q.put(None)

    @property
    def finished(self) -> bool:
        """True once the node's output ended and its exit status (or the connection loss) is known."""
        return self._done.is_set() and not self.lost

    def chunks(self) -> Iterable[bytes]:
        """The node's output (stdout and stderr merged) in raw blocks, until it ends or the connection is lost."""
        while True:
            data = self._q.get()
            if data is None:
                return
            yield data

    def lines(self) -> Iterable[str]:
        from broker.run.supervisor import chunk_lines

        yield from chunk_lines(self.chunks())

    def poll(self) -> int | None:
        if self._done.is_set():
            return self._code
        # The launched process has exited but the channel is still open: an orphaned descendant (torchrun
        # starts workers in their own sessions) holds the output pipe.  Count the node as ended after a short
        # drain period; stop() then kills the orphans by their environment marker.
        proc = self._proc
        if proc is not None and (proc.exit_status is not None or proc.exit_signal is not None):
            if self._exited_at is None:
                self._exited_at = time.monotonic()
            elif time.monotonic() - self._exited_at > EXIT_DRAIN_S:
                rc = proc.returncode
                return 255 if rc is None else rc
        return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Kill the remote process group and its descendants over a second channel; idempotent."""
        if self._done.is_set() and not self.lost:
            return
        i = self.node_rank
        cmd = f"{self.ssh.py(i)} {shlex.quote(self.ssh.probe(i))} kill " \
              f"{shlex.quote(self.ssh.base(i) + '/torchrun.pid')} {grace_s:g} " \
              f"BROKER_RUN_ID={shlex.quote(self.ssh.cluster.run_id)} BROKER_NODE_RANK={i}"
        try:
            self.ssh.run(i, cmd, timeout=grace_s + 20)
        except Exception as e:  # node unreachable: teardown of the machine is the caller's job
            self._q.put(f"broker: could not stop node {i} over ssh: {e}\n")
        if not self._done.wait(grace_s + 10):
            async def _close() -> None:
                if self._proc is not None:
                    self._proc.close()
            try:
                self.ssh.loop.call(_close(), timeout=5)
            except Exception:  # pragma: no cover
                pass
            self._done.wait(5)


def node_root(cluster: Cluster, i: int) -> str:
    """Node ``i``'s workroot: its own (``ClusterNode.workroot``, e.g. this machine in a hybrid run) or the
    cluster's."""
    return (cluster.nodes[i].workroot if i < len(cluster.nodes) else None) or cluster.workroot


def node_python(cluster: Cluster, i: int | None) -> str:
    """Node ``i``'s training interpreter: its own (``ClusterNode.python``) or the cluster's."""
    if i is not None and i < len(cluster.nodes) and cluster.nodes[i].python:
        return cluster.nodes[i].python  # type: ignore[return-value]
    return cluster.python


def node_base(cluster: Cluster, i: int) -> str:
    """Node ``i``'s folder for this run: ``<workroot>/<run_id>/node<i>`` (simulated nodes share a host)."""
    return f"{node_root(cluster, i).rstrip('/')}/{cluster.run_id}/node{i}"
