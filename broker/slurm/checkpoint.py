"""The recipe's ``checkpoint_dir`` in a Slurm job folder as a :class:`broker.run.checkpoint.Source`, so the one
copy-back of :mod:`broker.run.checkpoint` (incremental, atomic, confined) serves Slurm runs too.

The job folder lies on the cluster's shared file system: every node of the allocation sees the same folder, and
rank 0 (node 0) is the one that writes the checkpoint (the pattern ``recipes/ddp_train.py`` uses), so reading
``<job folder>/<checkpoint_dir>`` where the Slurm commands run (this machine, or the login node through ``ssh``)
reads node 0's checkpoint without an ``srun`` step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from broker.run.checkpoint import Source, lister_command, parse_listing

if TYPE_CHECKING:
    from broker.run.artifacts import ArtifactBudget


class ShellSource(Source):
    """``folder`` on the machine behind ``shell`` (a :class:`broker.slurm.shell.Shell` with a host): listed with
    :func:`broker.run.checkpoint.lister_command` (``python3`` on that machine), each file fetched by ``fetch(folder,
    rel, dst, budget) -> bytes`` (:meth:`broker.slurm.executor.SlurmExecutor.fetch_remote`: resolved there, a link
    out of ``folder`` refused, never more than the cap read)."""

    def __init__(self, shell, folder: str, fetch: Callable[[str, str, Path, "ArtifactBudget"], int]):
        self.shell, self.folder, self._fetch = shell, folder, fetch

    def list(self) -> dict[str, tuple[int, int]]:
        """Raises ProviderError (the listing failed there) or RefusedArtifact (its answer is not a listing)."""
        from broker.core.provider import ProviderError
        from broker.run.artifacts import RefusedArtifact

        cp = self.shell.run(["sh", "-c", lister_command(self.folder)], call="list checkpoint", timeout=120)
        out = cp.stdout.decode("utf-8", "replace") if isinstance(cp.stdout, bytes) else str(cp.stdout or "")
        if cp.returncode != 0:
            err = cp.stderr.decode("utf-8", "replace") if isinstance(cp.stderr, bytes) else str(cp.stderr or "")
            raise ProviderError("slurm", "list checkpoint", f"exit {cp.returncode} {self.shell.where}: "
                                f"{err.strip()[-300:]}", hint="python3 must be on the login node's PATH")
        try:
            raw = json.loads(out)
        except ValueError:
            raise RefusedArtifact(f"the list of checkpoint files is not JSON: {out[:80]!r}") from None
        return parse_listing(raw)

    def fetch(self, rel: str, dst: Path, budget: "ArtifactBudget") -> int:
        """Raises FileNotFoundError when the file went away after the listing (the copy is then not whole)."""
        got = self._fetch(self.folder, rel, dst, budget)
        if got is None:
            raise FileNotFoundError(f"{rel!r} was gone from the checkpoint folder before it was copied")
        return got
