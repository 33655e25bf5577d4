"""Checkpoint copy-back and restore: the recipe's ``checkpoint_dir`` (a folder relative to the work folder) is
copied from node 0 into ``<run>/checkpoints/`` every ``checkpoint_every_s`` seconds while the job runs and once
when it ends, and put back on every node of a later attempt before its launch (:mod:`broker.run.attempts`).

Layout of ``<run>/checkpoints/``::

    gen-000001/...        one complete copy (a "generation") of node 0's checkpoint_dir
    gen-000001.json       its manifest: {relative name: [size bytes, mtime ns]}
    LATEST                the name of the newest complete generation (replaced atomically, written last)

A copy is **incremental**: a file whose size and mtime match the previous generation's manifest is hard-linked
from it, only changed files cross the network.  It is **atomic**: the new generation is built in
``.tmp-gen-N/``, renamed to ``gen-N`` only when every file arrived, and ``LATEST`` moves to it after that
(``os.replace``); a copy cut short (the node preempted mid-copy, a file over the size cap) leaves ``LATEST`` on the last
good generation and its temp folder is removed.  The two newest generations are kept; while a new one is built
only ``LATEST`` stays beside it.  The run's size cap (:class:`broker.run.artifacts.ArtifactBudget`: per file, and
for all of ``checkpoints/`` together) is counted on what lies on disk there, so repeated copies never add up past it.

A node is input, not authority: every name is checked with :func:`broker.run.artifacts.artifact_destination`, files
are written with :func:`broker.run.artifacts.write_capped` / :func:`broker.run.remote.afetch_checked` (O_NOFOLLOW,
0600, within an :class:`broker.run.artifacts.ArtifactBudget`), a symlink out of the folder, a FIFO or a name with
control characters is refused: that file is skipped, the rest copied, and the refusal said on the terminal and in
the run's summary and record (a copy that fails is said the same way).  Files
named ``*.tmp`` / ``*.partial`` are skipped: a script writes its checkpoint there and renames it into place (the
pattern ``recipes/ddp_train.py`` uses), so a half-written file is never copied.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from broker.run.executor import Executor, NoCheckpoints

if TYPE_CHECKING:
    from broker.run.artifacts import ArtifactBudget
    from broker.run.supervisor import RunResult

_log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
KEEP_GENERATIONS = 2
_GEN = re.compile(r"^gen-(\d{6})$")
#: in-progress names a script writes before renaming into place: never copied
SKIP_SUFFIXES = (".tmp", ".partial")

Say = Callable[[str], None] | None


class CopyFailed(Exception):
    """One copy-back could not complete; the last good generation stays (the message says why)."""


# --------------------------------------------------------------------------------------------------- sources
class Source:
    """Node 0's ``checkpoint_dir``: :meth:`list` its files, :meth:`fetch` one into a local file; :meth:`restore` a
    generation on every node.  What :meth:`broker.run.executor.Executor.checkpoint_source` returns."""

    def list(self) -> dict[str, tuple[int, int]]:
        """``{relative name: (size bytes, mtime ns)}`` of the files (names unchecked: the caller validates)."""
        raise NotImplementedError

    def fetch(self, rel: str, dst: Path, budget: "ArtifactBudget") -> int:
        """Copy file ``rel`` to the new local file ``dst`` within ``budget``; returns the bytes written.
        Raises RefusedArtifact (a link out of the folder, not a regular file, over a cap) or OSError/SSH errors."""
        raise NotImplementedError

    def restore(self, gen: Path, run_dir: Path) -> None:
        """Put generation ``gen`` in place as ``checkpoint_dir`` (replaced) on every node; ``run_dir``: the run's
        folder for temporary files.  Raises CopyFailed where this source cannot write the nodes (the default: a
        source for the copy-back only, such as a Slurm job folder: its runs are never restarted), or what the
        copy raises."""
        raise CopyFailed(f"{type(self).__name__} copies checkpoints back but cannot put one on the nodes")


class LocalSource(Source):
    """A folder on this machine (the local executor's node work folder, the ``fake`` cloud)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def list(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        if not self.folder.is_dir():
            return out
        for dirpath, dirnames, files in os.walk(self.folder):  # followlinks=False: a linked folder is not walked
            for name in files:
                p = Path(dirpath, name)
                st = p.lstat()
                out[p.relative_to(self.folder).as_posix()] = (st.st_size, st.st_mtime_ns)
        return out

    def fetch(self, rel: str, dst: Path, budget: "ArtifactBudget") -> int:
        from broker.run.artifacts import RefusedArtifact, write_capped
        from broker.run.supervisor import READ_CHUNK

        base = os.path.realpath(self.folder).rstrip("/") + "/"
        real = os.path.realpath(self.folder / rel)
        if not real.startswith(base):
            raise RefusedArtifact(f"a symlink to {real!r}, outside the checkpoint folder")
        if not os.path.lexists(real):  # gone since the listing (the job replaced it): this copy is not whole
            raise FileNotFoundError(f"{rel!r} went away while the checkpoint was copied")
        if not os.path.isfile(real):
            raise RefusedArtifact("not a regular file")
        budget.check(os.stat(real).st_size)

        def _read() -> Iterable[bytes]:
            with open(real, "rb") as f:
                while data := f.read(READ_CHUNK):
                    yield data

        return write_capped(dst, _read(), budget)


class NodeFoldersSource(Source):
    """``rel_dir`` in the node work folders on this machine (the local executor's: node 0's is copied back, every
    node's is restored); ``dirs`` gives the folders, empty until the executor's ``stage`` made them."""

    def __init__(self, dirs: Callable[[], list[Path]], rel_dir: str):
        self.dirs, self.rel_dir = dirs, rel_dir

    def _node0(self) -> LocalSource | None:
        dirs = self.dirs()
        return LocalSource(Path(dirs[0]) / self.rel_dir) if dirs else None

    def list(self) -> dict[str, tuple[int, int]]:
        src = self._node0()
        return src.list() if src is not None else {}

    def fetch(self, rel: str, dst: Path, budget: "ArtifactBudget") -> int:
        src = self._node0()
        if src is None:
            raise FileNotFoundError("the node folders are not made yet")
        return src.fetch(rel, dst, budget)

    def restore(self, gen: Path, run_dir: Path) -> None:
        dirs = self.dirs()
        if not dirs:
            raise CopyFailed("the node folders are not made yet")
        for d in dirs:
            restore_local(gen, Path(d) / self.rel_dir)


#: lists a folder's files with size and mtime (ns) as JSON, run on the node inside that folder
_LISTER = ("import json, os; out = []\n"
           "for d, ds, fs in os.walk('.'):\n"
           "    for f in fs:\n"
           "        p = os.path.join(d, f); st = os.lstat(p)\n"
           "        out.append([os.path.relpath(p, '.'), st.st_size, st.st_mtime_ns])\n"
           "print(json.dumps(out))")


def lister_command(folder: str) -> str:
    """A ``sh -c`` line that prints :data:`_LISTER`'s JSON for ``folder`` on a machine with ``python3`` (``[]``
    while the folder does not exist)."""
    import shlex

    return f"cd {shlex.quote(folder)} 2>/dev/null || {{ echo '[]'; exit 0; }}; exec python3 -c {shlex.quote(_LISTER)}"


def parse_listing(raw: Any) -> dict[str, tuple[int, int]]:
    """:data:`_LISTER`'s answer (decoded JSON, from a node: untrusted) as ``{relative name: (size, mtime ns)}``.
    Raises RefusedArtifact for anything but a list of ``[name, size, mtime]`` entries."""
    from broker.run.artifacts import RefusedArtifact

    if not isinstance(raw, list):
        raise RefusedArtifact(f"the list of checkpoint files is {type(raw).__name__}, not a list")
    out: dict[str, tuple[int, int]] = {}
    for e in raw:
        if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in e[1:])):
            raise RefusedArtifact(f"the node's list of checkpoint files holds {repr(e)[:80]}")
        out[e[0]] = (e[1], e[2])
    return out


class SSHSource(Source):
    """``checkpoint_dir`` in node ``node``'s work folder over the executor's SSH connections
    (:class:`broker.run.remote.SSHCluster`; safe to call from another thread: its calls run on its loop).
    ``list_files`` / ``fetch_file``: the SSH executor's coroutines that list a node folder and fetch one file checked
    (:func:`broker.run.remote._alist_artifacts`, :func:`broker.run.remote.afetch_checked`), handed in by
    :meth:`broker.run.remote.SSHExecutor.checkpoint_source` so that this module never imports the executor's."""

    def __init__(self, ssh: Any, rel_dir: str, node: int = 0, *, list_files: Callable[..., Any],
                 fetch_file: Callable[..., Any]):
        self.ssh, self.rel_dir, self.node = ssh, rel_dir, node
        self.list_files, self.fetch_file = list_files, fetch_file

    @property
    def folder(self) -> str:
        return f"{self.ssh.work(self.node)}/{self.rel_dir}"

    def list(self) -> dict[str, tuple[int, int]]:
        raw = self.ssh.loop.call(self.list_files(self.ssh, self.node, [], folder=self.folder, lister=_LISTER,
                                                 missing_ok=True), timeout=120)
        return parse_listing(raw)

    def fetch(self, rel: str, dst: Path, budget: "ArtifactBudget") -> int:
        return self.ssh.loop.call(self.fetch_file(self.ssh, self.node, self.folder, rel, dst, budget), timeout=3600)

    def restore(self, gen: Path, run_dir: Path) -> None:
        restore_ssh(gen, self.ssh, self.rel_dir, range(len(self.ssh.cluster.nodes)), run_dir)


# --------------------------------------------------------------------------------------------------- generations
def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def latest_generation(run_dir: Path) -> Path | None:
    """The newest complete generation folder of ``run_dir`` (what ``LATEST`` names), or None."""
    root = checkpoints_root(run_dir)
    try:
        name = (root / LATEST).read_text().strip()
    except OSError:
        return None
    if not _GEN.match(name):
        return None
    gen = root / name
    return gen if gen.is_dir() and not gen.is_symlink() else None


def _manifest(gen: Path | None) -> dict[str, tuple[int, int]]:
    if gen is None:
        return {}
    try:
        raw = json.loads(gen.with_name(gen.name + ".json").read_text())
        return {str(k): (int(v[0]), int(v[1])) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return {}


def _next_number(root: Path) -> int:
    nums = [int(m.group(1)) for p in root.iterdir() if (m := _GEN.match(p.name.removeprefix(".tmp-")))] \
        if root.is_dir() else []
    return max(nums, default=0) + 1


def disk_bytes(root: Path) -> int:
    """Bytes the regular files under ``root`` hold on disk, each file once however many hard links name it (the
    generations share their unchanged files); 0 when ``root`` does not exist."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def copy_back(source: Source, run_dir: Path, *, budget: "ArtifactBudget | None" = None,
              say: Say = None, refused: list[str] | None = None) -> tuple[Path | None, int]:
    """One copy of ``source`` into a new generation under ``<run_dir>/checkpoints`` (module docstring); returns
    (the generation now named by ``LATEST``, bytes fetched this time).  Nothing changed since the last generation:
    no new generation, (the latest, 0).  An empty folder on the node makes no generation.

    A file broker will not take (a link out of the folder, not a regular file, a name with control characters or
    ``..``) is skipped and named in ``refused`` (``'name' (why)``, appended); the rest is copied.  The size cap is
    the run's, counted on what lies on disk under ``checkpoints/`` (the generation kept plus the one being built;
    ``budget.used`` is raised to that), never a fresh budget per copy.  Raises CopyFailed when the copy could not
    complete (the node went away mid-copy, the listing failed, a file would pass the cap); ``LATEST`` is
    unchanged then."""
    from broker.core.private import private_dirs, write_private
    from broker.run.artifacts import ArtifactBudget, OverCap, RefusedArtifact, artifact_destination

    root = private_dirs(checkpoints_root(run_dir))
    prev = latest_generation(run_dir)
    old = _manifest(prev)
    try:
        listing = {k: v for k, v in source.list().items() if not k.endswith(SKIP_SUFFIXES)}
    except Exception as e:  # noqa: BLE001 - the node is gone or answered nonsense: keep the last good copy
        raise CopyFailed(f"listing the checkpoint folder failed: {e}") from e
    if not listing or (prev is not None and listing == old):
        return prev, 0
    budget = budget or ArtifactBudget()
    if len(listing) > budget.max_files:
        raise CopyFailed(f"the checkpoint folder holds {len(listing)} files, more than the {budget.max_files} "
                         "broker copies")
    # while the new generation is built only LATEST stays: what is on disk is that one plus the new one, and the
    # run's cap holds for both together
    _prune(root, keep=prev.name if prev is not None else None, generations=1)
    budget.used = max(budget.used, disk_bytes(root))
    n = _next_number(root)
    tmp = root / f".tmp-gen-{n:06d}"
    fetched = 0
    skipped: list[str] = []
    try:
        private_dirs(tmp)
        for rel, meta in sorted(listing.items()):
            try:
                dst = artifact_destination(tmp, rel)
                if prev is not None and old.get(rel) == meta:
                    src = artifact_destination(prev, rel)
                    if src.is_file() and not src.is_symlink():
                        private_dirs(dst.parent)
                        os.link(src, dst, follow_symlinks=False)  # unchanged: the same bytes, no transfer
                        continue
                private_dirs(dst.parent)
                fetched += source.fetch(rel, dst, budget)
            except OverCap:
                raise  # a checkpoint missing a file for its size is no checkpoint: the copy stops
            except RefusedArtifact as e:
                skipped.append(f"{rel!r} ({e})")
        if refused is not None:
            refused.extend(skipped)
        if len(skipped) == len(listing):  # nothing could be taken: no generation
            shutil.rmtree(tmp, ignore_errors=True)
            return prev, 0
        gen = root / f"gen-{n:06d}"
        os.rename(tmp, gen)
        write_private(root / f"{gen.name}.json", json.dumps({k: list(v) for k, v in listing.items()}))
        write_private(root / f".{LATEST}.tmp", gen.name + "\n")
        os.replace(root / f".{LATEST}.tmp", root / LATEST)  # the switch: a reader sees the old or the new
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):
            raise CopyFailed(f"copying the checkpoint back stopped: {e}") from e
        raise
    _prune(root, keep=gen.name)
    _log.info("checkpoint generation %s: %d file(s), %d byte(s) fetched, %d refused", gen.name, len(listing),
              fetched, len(skipped))
    return gen, fetched


def _prune(root: Path, keep: str | None, generations: int = KEEP_GENERATIONS) -> None:
    """Remove all but the ``generations`` newest generations (never ``keep``) and stale temp folders."""
    gens = sorted((p for p in root.iterdir() if _GEN.match(p.name) and p.is_dir()), key=lambda p: p.name)
    for p in gens[:-generations]:
        if p.name != keep:
            shutil.rmtree(p, ignore_errors=True)
            (root / f"{p.name}.json").unlink(missing_ok=True)
    for p in root.iterdir():
        if p.name.startswith(".tmp-gen-"):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------------------------------- restore
def restore_local(gen: Path, dest: Path) -> int:
    """Put generation ``gen`` in place as the folder ``dest`` (replaced) on this machine; returns the file count."""
    from broker.core.private import private_dirs

    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    shutil.rmtree(dest, ignore_errors=True)
    private_dirs(dest.parent)
    shutil.copytree(gen, dest, symlinks=True)
    return sum(len(f) for _, _, f in os.walk(dest))


def restore_ssh(gen: Path, ssh: Any, rel_dir: str, nodes: Iterable[int], run_dir: Path) -> None:
    """Unpack generation ``gen`` as ``<work>/<rel_dir>`` (replaced) on each of ``nodes`` over SSH (one tar file
    on disk, streamed to every node).  Raises what the upload raises (ProviderError names the node)."""
    import tarfile

    from broker.run.staging import StagedTar

    tar = Path(run_dir) / ".checkpoint-restore.tar"
    try:
        with tarfile.open(tar, "w") as t:
            t.add(str(gen), arcname=".")
        data = StagedTar(path=tar, compressed=False)
        nodes = list(nodes)
        errs = ssh.gather([ssh.aupload_tgz(i, data, f"{ssh.work(i)}/{rel_dir}") for i in nodes], timeout=3600)
        for i, e in zip(nodes, errs):
            if isinstance(e, BaseException):
                raise e
    finally:
        tar.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------- executor
class CheckpointingExecutor(Executor):
    """Wraps an executor through its declared :meth:`~broker.run.executor.Executor.checkpoint_source` (``source``):
    after its ``stage`` the latest good generation is restored on every node; during its ``launch`` a thread copies
    node 0's ``checkpoint_dir`` back every ``every_s`` seconds; when the job ended (not when a node was lost) one
    last copy.  Copy failures are said and logged, never end the job.  Its steps are the inner executor's."""

    def __init__(self, inner: Executor, rel_dir: str, run_dir: Path, *, every_s: float, say: Say = None,
                 source: Source | None = None):
        self.inner, self.rel_dir, self.run_dir = inner, rel_dir, Path(run_dir)
        self._source = source
        self.every_s, self.say = float(every_s), say
        self.restored: Path | None = None
        self.copies = 0
        self.failures: list[str] = []
        self.refused: list[str] = []  # 'name' (why) of every checkpoint file refused, in order
        self.failed_last = False  # the newest copy failed (the newest good generation is older)
        self._said: set[str] = set()
        self._lock = threading.Lock()  # one copy at a time (the thread's and the final one)

    def steps(self) -> tuple[str, ...]:
        return self.inner.steps()  # run_steps announces only the steps the inner executor has

    def reach(self) -> "RunResult | None":
        return self.inner.reach()

    def preflight(self) -> "RunResult | None":
        return self.inner.preflight()

    def checkpoint_source(self, rel_dir: str) -> "Source | NoCheckpoints":
        return self.inner.checkpoint_source(rel_dir)

    def stage(self) -> "RunResult | None":
        res = self.inner.stage()
        if res is not None:
            return res
        gen = latest_generation(self.run_dir)
        if gen is None:
            return None
        try:
            self._restore(gen)
        except Exception as e:  # noqa: BLE001 - a node that cannot take the checkpoint cannot resume the job
            from broker.run.supervisor import RunResult

            return RunResult(status="failed", exit_codes={}, wall_s=0.0, log_paths=getattr(self.inner, "logs", {}),
                             reason=f"restoring checkpoint {gen.name} on the new node(s) failed: {e}")
        self.restored = gen
        if self.say:
            self.say(f"restored checkpoint {gen.name} ({self.rel_dir}) on every node")
        return None

    def _restore(self, gen: Path) -> None:
        src = self.source()
        if src is None:
            raise CopyFailed(f"{type(self.inner).__name__} declares no checkpoint source")
        src.restore(gen, self.run_dir)

    def source(self) -> Source | None:
        """The inner executor's declared source (None: none was given)."""
        return self._source

    def copy_now(self) -> Path | None:
        """One copy-back now (thread-safe); returns the latest generation, None when there is none.  Never raises
        for a failed copy: it is counted in ``failures`` and said (each reason once); a refused file is named in
        ``refused`` and said once."""
        src = self.source()
        if src is None:
            return None
        with self._lock:
            skipped: list[str] = []
            try:
                gen, got = copy_back(src, self.run_dir, refused=skipped)
            except CopyFailed as e:
                self.failures.append(str(e))
                self.failed_last = True
                _log.warning("checkpoint copy-back: %s", e)
                last = latest_generation(self.run_dir)
                self._say_once(f"checkpoint copy failed, {last.name if last else 'no copy'} stays the one a new "
                               f"attempt resumes from: {e}")
                return last
            finally:
                for r in skipped:
                    if r not in self.refused:
                        self.refused.append(r)
                        self._say_once(f"checkpoint file refused, not copied: {r}")
            self.failed_last = False
            if got:
                self.copies += 1
                self.bytes_out += got  # fetched from the node: billed where bandwidth is (pipeline)
            return gen

    def _say_once(self, line: str) -> None:
        if line in self._said:
            return
        self._said.add(line)
        _log.warning("%s", line)
        if self.say:
            self.say(line)

    def notes(self) -> list[str]:
        """What the run's summary and record say about its checkpoints: files refused, copies that failed (empty
        when every copy went through whole)."""
        out = []
        if self.refused:
            shown = "; ".join(self.refused[:5]) + (f"; and {len(self.refused) - 5} more" if len(self.refused) > 5
                                                   else "")
            out.append(f"checkpoint file(s) refused, not copied: {shown}")
        if self.failures and (self.failed_last or latest_generation(self.run_dir) is None):
            last = latest_generation(self.run_dir)
            out.append(f"checkpoint copy failed {len(self.failures)} time(s), last: {self.failures[-1]} "
                       f"({'the newest good copy is ' + last.name if last else 'no checkpoint was copied'})")
        return out

    def launch(self) -> "RunResult":
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(self.every_s):
                self.copy_now()

        t = threading.Thread(target=loop, name="checkpoint-copy", daemon=True)
        t.start()
        res = None
        try:
            res = self.inner.launch()
        finally:
            stop.set()
            t.join(timeout=60)
        if res is not None and None not in res.exit_codes.values():  # every node answered: its disk is there
            gen = self.copy_now()
            if gen is not None and self.say and not self.failed_last:
                self.say(f"checkpoint {self.rel_dir} copied back: {gen}")
        return res

    def collects(self) -> bool:
        return self.inner.collects()

    def collect(self, result: "RunResult") -> None:
        self.inner.collect(result)

    def finish(self, result: "RunResult") -> "RunResult":
        res = self.inner.finish(result)
        notes = self.notes()
        if notes:  # said while it ran; the summary and the ledger's record say it too
            why = "; ".join(notes)
            if res.status == "succeeded":
                res.warnings = [*res.warnings, *notes]
            res.reason = f"{res.reason}; {why}" if res.reason else why
        return res

    def close(self, job_ended: bool) -> None:
        self.inner.close(job_ended)


def with_checkpoints(ex: Executor, recipe: Any, run_dir: Path, say: Say = None) -> Executor:
    """``ex`` wrapped in :class:`CheckpointingExecutor` when the recipe names a ``checkpoint_dir``, through the
    source ``ex`` declares (:meth:`~broker.run.executor.Executor.checkpoint_source`); ``ex`` unchanged when the recipe
    names none, or when ``ex`` declares :class:`~broker.run.executor.NoCheckpoints` (then its reason is said and
    logged: the run goes on without checkpoints, never silently)."""
    rel = getattr(recipe, "checkpoint_dir", None)
    if not rel:
        return ex
    src = ex.checkpoint_source(rel)
    if isinstance(src, NoCheckpoints):
        line = f"checkpoint_dir {rel} is not copied back: {src.reason}"
        _log.warning("%s", line)
        if say:
            say(line)
        return ex
    return CheckpointingExecutor(ex, rel, run_dir, every_s=float(getattr(recipe, "checkpoint_every_s", 60) or 60),
                                 say=say, source=src)
