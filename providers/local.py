"""This machine as a free ``local`` (``simulated``) topology: one host whose GPUs are split into N single-GPU nodes.

GPUs are detected without importing torch (the CLI must start fast): ``nvidia-smi --query-gpu`` when present,
else the driver's ``/proc/driver/nvidia/gpus`` listing (model only).  ``CUDA_VISIBLE_DEVICES``, when already set,
restricts what this machine offers.  Node *i* gets ``CUDA_VISIBLE_DEVICES`` = its own GPUs, so with one GPU per
node every node sees its GPU as ``cuda:0``.  Without GPUs the job runs with gloo on CPU when the recipe allows
``cpu_ok``; otherwise :meth:`LocalProvider.why_not` says why this machine cannot serve it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.core.model import Offer, Requirements, TopologyKind, utcnow
from broker.core.provider import NotSupported, Provider, ProviderCheck
from broker.providers.declared import LOCAL

if TYPE_CHECKING:
    from broker.core.records import TaggedResource


@dataclass(frozen=True)
class LocalGpu:
    """One GPU of this machine: ``index`` as CUDA numbers it, memory in GiB (0 when unknown)."""

    index: str
    name: str
    mem_gib: float


def _which(name: str) -> str | None:
    """The first executable ``name`` on ``PATH`` (``shutil.which`` for a bare name on Linux): shutil, with the
    compression modules it imports, is not loaded on ``broker plan``'s start-up for one lookup."""
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        p = os.path.join(d or ".", name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def detect_gpus(nvidia_smi: str | None = None, proc_dir: Path = Path("/proc/driver/nvidia/gpus")) -> list[LocalGpu]:
    """GPUs visible to this process (honours an existing ``CUDA_VISIBLE_DEVICES``); [] when none."""
    gpus: list[LocalGpu] = []
    smi = nvidia_smi or _which("nvidia-smi")
    if smi:
        import subprocess  # only where nvidia-smi exists: broker plan's start-up skips it elsewhere

        try:
            out = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
            for line in out.strip().splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) >= 3:
                    mem = float(parts[2]) / 1024 if parts[2].replace(".", "", 1).isdigit() else 0.0
                    gpus.append(LocalGpu(parts[0], parts[1], round(mem, 1)))
        except (OSError, subprocess.SubprocessError):
            gpus = []
    if not gpus and proc_dir.is_dir():
        for i, d in enumerate(sorted(proc_dir.iterdir())):
            model = "NVIDIA GPU"
            info = d / "information"
            if info.exists():
                for line in info.read_text(errors="replace").splitlines():
                    if line.startswith("Model:"):
                        model = line.split(":", 1)[1].strip()
            gpus.append(LocalGpu(str(i), model, 0.0))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        if not wanted or wanted == ["-1"]:
            return []
        by_index = {g.index: g for g in gpus}
        gpus = [by_index[w] for w in wanted if w in by_index]
    return gpus


class LocalProvider(Provider):
    """This machine.  Free; one topology: ``local`` (N simulated nodes on loopback)."""

    name = "local"
    #: what it can do, and why not (providers/declared.py; the registry reads the same object)
    caps = LOCAL

    @classmethod
    def run_target(cls, recipe: Any, request: Any, *, say: Any = None) -> Any:
        """:class:`broker.run.targets.LocalTarget`: this machine, free.  Says why when the plan chose it among
        several (``request.plan``), or that ``interruptible: true`` does not apply here; raises BadInput for
        ``--topology hybrid`` and NoValidPlan when this machine cannot serve the recipe."""
        from broker.run.planstep import local_choice_text, local_interruptible_note, no_hybrid_here
        from broker.run.targets import LocalTarget

        if (request.topology or recipe.topology) == "hybrid":
            raise no_hybrid_here(cls.name)
        plan = request.plan
        if plan is None:
            note = local_interruptible_note(recipe, "this machine")
            if note and say:
                say(note)
        elif say:
            from broker.plan.explain import NO_OFFER_FOR_MODEL

            say(local_choice_text(plan, recipe))
            for note in plan.notes:  # a mistyped --gpu / gpu.models is why no rented option was left: say so
                if note.startswith(NO_OFFER_FOR_MODEL):
                    say(f"warning: {note.split(';')[0]}")
        return LocalTarget(recipe)

    def __init__(self, gpus: list[LocalGpu] | None = None):
        self._gpus = gpus

    @property
    def gpus(self) -> list[LocalGpu]:
        if self._gpus is None:
            self._gpus = detect_gpus()
        return self._gpus

    def check(self) -> ProviderCheck:
        g = self.gpus
        detail = f"{len(g)} GPU(s): {', '.join(x.name for x in g)}" if g else "no GPU (gloo on CPU for cpu_ok recipes)"
        return ProviderCheck(provider=self.name, configured=True, usable=True, detail=detail)

    def why_not(self, req: Requirements) -> str | None:
        """None when this machine can run ``req``; else the reason in plain words."""
        need = req.nodes * req.gpus_per_node
        g = self.gpus
        if not g:
            if req.cpu_ok:
                return None
            from broker.core.model import Rejection

            # as data: the no-plan hint names --cpu-ok from ``lifted_by``, never from these words
            return Rejection("provider", f"this machine has no GPU and the job needs {need} GPU(s); allow a CPU "
                             "logic check (gloo) with cpu_ok: true in the recipe or --cpu-ok", lifted_by="cpu_ok")
        if len(g) < need:
            if req.cpu_ok:
                return None
            return f"this machine has {len(g)} GPU(s), the job needs {need} ({req.nodes} nodes x {req.gpus_per_node})"
        small = [x for x in g[:need] if x.mem_gib and x.mem_gib < req.gpu_mem_floor_gib]
        if small and not req.cpu_ok:
            return f"GPU {small[0].name} has {small[0].mem_gib} GiB, the job needs {req.min_gpu_mem_gib} GiB per GPU"
        return None

    def uses_gpus(self, req: Requirements) -> bool:
        """True when the job gets one GPU per process here (else gloo on CPU)."""
        g, need = self.gpus, req.nodes * req.gpus_per_node
        return need > 0 and len(g) >= need and not any(
            x.mem_gib and x.mem_gib < req.gpu_mem_floor_gib for x in g[: req.nodes * req.gpus_per_node])

    def node_env(self, req: Requirements, node_rank: int) -> dict[str, str]:
        """Environment for node ``node_rank``: its own GPUs, or none (CPU)."""
        if not self.uses_gpus(req):
            return {"CUDA_VISIBLE_DEVICES": ""}
        mine = self.gpus[node_rank * req.gpus_per_node:(node_rank + 1) * req.gpus_per_node]
        return {"CUDA_VISIBLE_DEVICES": ",".join(x.index for x in mine)}

    def terminate(self, kind: str, provider_id: str, *, region: str | None = None,
                  attrs: dict[str, Any] | None = None) -> bool:
        """``local_node`` (this machine's part of a hybrid run on rented VMs: node 0's job, the WireGuard interface
        with its ``wireguard-go`` and key folder): removed by :func:`broker.run.hybrid.local_node_down`; idempotent,
        True once gone.  Nothing else on this machine is a resource."""
        if kind != "local_node":
            raise NotSupported(self.name, "terminate", f"this machine has no {kind} resources")
        from broker.run.hybrid import local_node_down

        local_node_down(attrs or {})
        return True

    def list_tagged(self, run_id: str | None = None) -> list[TaggedResource]:
        """This machine's part of hybrid runs that may still exist (``local_node``): a run whose key folder
        ``<runs>/<run_id>/wg`` or tunnel interface (``bkwg`` + the run id's tail) is still here; lets a teardown
        that finds the ledger row without its id (the CLI died while the interface came up) remove it anyway."""
        from broker.core.records import TaggedResource
        from broker.core.config import runs_dir
        from broker.run.hybrid import local_iface

        out = []
        for d in runs_dir().glob(run_id or "*"):
            if (d / "wg").is_dir() or Path("/sys/class/net", local_iface(d.name)).exists():
                out.append(TaggedResource(provider=self.name, kind="local_node", provider_id="node0", run_id=d.name,
                                          name="node0", state="running", usd_per_hour=0.0))
        return out

    def machine_offer(self) -> Offer:
        """This machine as one free offer, whatever a job asks: its GPUs (count, model, GiB each), or none
        (``CPU (gloo)``, 0 GPUs) on a machine without one; what ``broker offers --provider local`` lists."""
        g = self.gpus
        return Offer(provider="local", offer_id="this-machine", instance_type="this machine",
                     gpu_name=g[0].name if g else "CPU (gloo)", gpu_count=len(g),
                     gpu_mem_gib=g[0].mem_gib if g else 0.0,
                     vcpus=os.cpu_count() or 1, usd_per_hour=0.0, min_billed_seconds=0,
                     price_source="free (this machine)", price_time=utcnow(),
                     attrs={"topology": TopologyKind.local.value, "cpu": not g})

    def offers(self, req: Requirements) -> list[Offer]:
        if self.why_not(req) is not None:
            return []
        g = self.gpus
        use_gpu = self.uses_gpus(req)
        return [Offer(provider="local", offer_id="this-machine", instance_type="this machine",
                      gpu_name=g[0].name if use_gpu else "CPU (gloo)", gpu_count=len(g) if use_gpu else 0,
                      gpu_mem_gib=g[0].mem_gib if use_gpu else 0.0, vcpus=os.cpu_count() or 1,
                      usd_per_hour=0.0, min_billed_seconds=0, price_source="free (this machine)",
                      price_time=utcnow(), attrs={"topology": TopologyKind.local.value, "cpu": not use_gpu})]
