"""This machine as one node of an SSH cluster: the part of asyncssh's connection API that
:class:`broker.run.sshcluster.SSHCluster`, :class:`broker.run.sshcluster.RemoteNode` and :mod:`broker.run.preflight` use, served by
local processes and local files.

A ``hybrid`` run's node 0 is this machine while nodes 1..N-1 are VMs reached over SSH; its
:class:`~broker.core.model.ClusterNode` carries ``local=True`` and :meth:`broker.run.sshcluster.SSHCluster._connect` returns a
:class:`LocalConnection` for it.  Everything else (probe upload, preflight, staging, setup, ``torchrun`` with the
pid file and the kill by environment marker, log streaming, artifacts, ``job.done``) is the SSH executor's own
code path, unchanged: one executor for the mixed cluster instead of a copy of it.

Commands run as ``bash -c CMD`` (``sh`` without bash) in a new session, with this process's environment minus the
rendezvous variables a local run drops (:func:`broker.run.launch.node_environment`) and minus ``TS_AUTHKEY``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path
from typing import Any

#: variables never passed to node 0's commands (secrets broker itself reads)
NOT_PASSED = ("TS_AUTHKEY",)


def _shell() -> str:
    return shutil.which("bash") or "/bin/sh"


def _env() -> dict[str, str]:
    from broker.run.launch import node_environment

    env = node_environment(dict(os.environ))
    for k in NOT_PASSED:
        env.pop(k, None)
    return env


class _Text:
    """An asyncio byte stream read as text lines (asyncssh's ``encoding="utf-8"`` reader), or as bytes with
    ``encoding=None`` (asyncssh's raw reader)."""

    def __init__(self, reader: asyncio.StreamReader | None, encoding: str | None = "utf-8"):
        self.reader = reader
        self.encoding = encoding

    def _out(self, data: bytes) -> Any:
        return data if self.encoding is None else data.decode(self.encoding, "replace")

    async def readline(self) -> Any:
        if self.reader is None:
            return self._out(b"")
        return self._out(await self.reader.readline())

    async def read(self, n: int = -1) -> Any:
        """Up to ``n`` bytes as soon as some are there (``-1``: everything until the end), as asyncssh reads."""
        if self.reader is None:
            return self._out(b"")
        return self._out(await self.reader.read(n))

    def __aiter__(self) -> "_Text":
        return self

    async def __anext__(self) -> str:
        line = await self.readline()
        if not line:
            raise StopAsyncIteration
        return line


class LocalProcess:
    """A local process with asyncssh's ``SSHClientProcess`` surface: ``stdout``/``stderr`` text readers,
    ``wait()``, ``returncode``, ``exit_status``, ``exit_signal``, ``close()``."""

    def __init__(self, proc: asyncio.subprocess.Process, encoding: str | None = "utf-8"):
        self.proc = proc
        self.stdout = _Text(proc.stdout, encoding)
        self.stderr = _Text(proc.stderr, encoding)

    @property
    def exit_status(self) -> int | None:
        rc = self.proc.returncode
        return rc if rc is not None and rc >= 0 else None

    @property
    def exit_signal(self) -> tuple[str, bool, str, str] | None:
        rc = self.proc.returncode
        return (signal.Signals(-rc).name, False, "", "") if rc is not None and rc < 0 else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> "LocalProcess":
        await self.proc.wait()
        return self

    def close(self) -> None:
        """End the command (its process group: the shell and what it started in that session)."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass


class _Starting:
    """``conn.create_process(...)``: awaitable (the process) and an async context manager (closed on exit)."""

    def __init__(self, coro: Any):
        self.coro = coro
        self.proc: LocalProcess | None = None

    def __await__(self) -> Any:
        return self.coro.__await__()

    async def __aenter__(self) -> LocalProcess:
        self.proc = await self.coro
        return self.proc

    async def __aexit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.close()


class _Result:
    def __init__(self, returncode: int | None, stdout: str):
        self.returncode, self.exit_status, self.stdout, self.stderr = returncode, returncode, stdout, ""


class _File:
    def __init__(self, path: str, mode: str, permissions: int | None = None):
        # created with its final mode, as the SFTP server does with the open's attributes
        self.f = open(path, mode, opener=None if permissions is None else
                      (lambda p, flags: os.open(p, flags, permissions)))

    async def write(self, data: bytes | str) -> None:
        self.f.write(data)

    async def read(self, size: int = -1) -> bytes | str:
        return self.f.read(size)

    async def __aenter__(self) -> "_File":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.f.close()


class LocalSFTP:
    """asyncssh's SFTP client calls used by broker, on local paths."""

    async def makedirs(self, path: str, exist_ok: bool = False) -> None:
        Path(path).mkdir(parents=True, exist_ok=exist_ok)

    def open(self, path: str, mode: str = "r", attrs: Any = None) -> _File:
        return _File(path, mode, getattr(attrs, "permissions", None))

    async def remove(self, path: str) -> None:
        import asyncssh

        try:
            os.unlink(path)
        except FileNotFoundError:
            raise asyncssh.SFTPNoSuchFile(f"{path}: no such file") from None

    async def chmod(self, path: str, mode: int) -> None:
        os.chmod(path, mode)

    async def get(self, remote: str, local: str) -> None:
        import asyncssh

        if not os.path.isfile(remote):
            raise asyncssh.SFTPNoSuchFile(f"{remote}: no such file")
        if os.path.abspath(remote) != os.path.abspath(local):
            shutil.copyfile(remote, local)

    async def put(self, local: str, remote: str) -> None:
        """Copy the local file ``local`` to ``remote`` (this machine: a plain copy, created 0600)."""
        if os.path.abspath(remote) == os.path.abspath(local):
            return
        fd = os.open(remote, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(local, "rb") as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)

    async def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    async def stat(self, path: str) -> Any:
        """The file's size and mode, as asyncssh's ``SFTPAttrs`` (``size``, ``permissions``) carries them."""
        import asyncssh

        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise asyncssh.SFTPNoSuchFile(f"{path}: no such file") from None
        return asyncssh.SFTPAttrs(size=st.st_size, permissions=st.st_mode)

    async def listdir(self, path: str) -> list[str]:
        import asyncssh

        try:
            return [".", "..", *os.listdir(path)]
        except FileNotFoundError:
            raise asyncssh.SFTPNoSuchFile(f"{path}: no such directory") from None

    async def __aenter__(self) -> "LocalSFTP":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass


class LocalConnection:
    """This machine behind the connection API of :class:`broker.run.sshcluster.SSHCluster` (see the module docstring)."""

    def __init__(self) -> None:
        self._closed = False
        self._procs: list[LocalProcess] = []

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        for p in self._procs:
            p.close()

    async def wait_closed(self) -> None:
        return None

    def get_server_host_key(self) -> None:
        return None

    async def _spawn(self, cmd: str, *, merge: bool, encoding: str | None = "utf-8") -> LocalProcess:
        import asyncio.subprocess as sp

        proc = await asyncio.create_subprocess_exec(
            _shell(), "-c", cmd, stdin=sp.DEVNULL, stdout=sp.PIPE, stderr=sp.STDOUT if merge else sp.PIPE,
            env=_env(), cwd=os.path.expanduser("~"), start_new_session=True)
        lp = LocalProcess(proc, encoding)
        self._procs = [p for p in self._procs if p.returncode is None] + [lp]
        return lp

    def create_process(self, cmd: str, *, stderr: Any = None, encoding: str | None = "utf-8",
                       errors: str = "strict", **_: Any) -> _Starting:
        import asyncssh

        return _Starting(self._spawn(cmd, merge=stderr is asyncssh.STDOUT, encoding=encoding))

    async def run(self, cmd: str, *, check: bool = False, timeout: float | None = None, stderr: Any = None,
                  **_: Any) -> _Result:
        """``cmd`` to its end (output with stderr merged); after ``timeout`` s its process group is killed and the
        result has ``returncode`` None (what :meth:`broker.run.sshcluster.SSHCluster.arun` reports for a timeout)."""
        p = await self._spawn(cmd, merge=True)
        try:
            out = await asyncio.wait_for(p.stdout.read(), timeout)
            await p.wait()
            return _Result(p.returncode, out)
        except asyncio.TimeoutError:
            try:
                os.killpg(p.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            await p.wait()  # reaped here, on the loop: a transport left to the collector outlives its loop
            return _Result(None, f"timed out after {timeout:.0f} s")

    def start_sftp_client(self) -> LocalSFTP:
        return LocalSFTP()
