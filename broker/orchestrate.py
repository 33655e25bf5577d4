"""``broker run`` end to end: recipe -> target -> ledger run -> launch -> result.

The CLI calls :func:`run_recipe`; it records the run in the ledger before anything starts, writes the recipe and
the plan into the run directory, launches, and records exit codes, status and log paths at the end (also after
Ctrl-C or a crash of the job).
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from broker.config import runs_dir
from broker.launch import LocalLaunchSpec, RunResult, run_local
from broker.ledger import Ledger, new_id
from broker.model import Run, utcnow
from broker.provider import AuthError, NoValidPlan
from broker.recipe import Recipe

if TYPE_CHECKING:
    from broker.model import Plan, PlanOption


def new_run(ledger: Ledger, recipe: Recipe, *, provider: str, topology: str, plan: dict | None = None) -> Run:
    """Create the run row and its directory (``<home>/runs/<run_id>``) with recipe.json and plan.json."""
    run_id = utcnow().strftime("%Y%m%d-%H%M%S-") + new_id()[:6]
    run_dir = runs_dir() / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    now = utcnow()
    recipe_data = recipe.model_dump(mode="json")
    (run_dir / "recipe.json").write_text(json.dumps(recipe_data, indent=2))
    if plan is not None:
        (run_dir / "plan.json").write_text(json.dumps(plan, indent=2, default=str))
    run = Run(id=run_id, name=recipe.name, recipe_path=str(recipe.path) if recipe.path else None,
              recipe=recipe_data, plan=plan, provider=provider, topology=topology, status="running",
              created_at=now, started_at=now, deadline=now + timedelta(hours=recipe.max_hours),
              budget_usd=recipe.budget_usd, run_dir=str(run_dir), pid=os.getpid())
    return ledger.create_run(run)


def end_run(ledger: Ledger, run_id: str, result: RunResult | None, *, status: str, message: str | None,
            actor: str = "cli", **fields: object) -> Run:
    """Record the end of a run: status, end time, per-node exit codes and log paths from ``result`` (none when the
    job never produced one), the message, an ``end`` event; returns the updated row."""
    ledger.update_run(run_id, status=status, ended_at=utcnow(), message=message,
                      exit_codes={str(k): v for k, v in (result.exit_codes.items() if result else [])},
                      log_paths={str(k): str(v) for k, v in (result.log_paths.items() if result else [])},
                      **fields)
    ledger.event(run_id, actor, "end", status)
    updated = ledger.get_run(run_id)
    assert updated is not None
    return updated


def local_spec(recipe: Recipe) -> tuple[LocalLaunchSpec, str]:
    """The launch spec for the ``local`` topology and a one-line description of the devices used.

    Raises NoValidPlan when this machine cannot serve the recipe (no GPU and not cpu_ok, too few GPUs...).
    """
    from broker.providers.local import LocalProvider

    local = LocalProvider()
    req = recipe.requirements()
    why = local.why_not(req)
    if why:
        raise NoValidPlan(f"this machine cannot run {recipe.name}: {why}",
                          hint="use --provider with a cloud provider, or allow a CPU logic check (cpu_ok: true)")
    node_envs = [local.node_env(req, i) for i in range(recipe.nodes)]
    if local.uses_gpus(req):
        devices = "; ".join(f"node {i}: CUDA_VISIBLE_DEVICES={e['CUDA_VISIBLE_DEVICES']}" for i, e in enumerate(node_envs))
    else:
        devices = "no GPU used: gloo on CPU (cpu_ok)"
    assert recipe.workdir is not None
    spec = LocalLaunchSpec(script_rel=str(recipe.script.relative_to(recipe.workdir)), args=list(recipe.args),
                           workdir=recipe.workdir, nnodes=recipe.nodes, nproc_per_node=recipe.gpus_per_node,
                           env=dict(recipe.env), node_envs=node_envs, setup=list(recipe.setup),
                           expect=list(recipe.expect), deadline_s=recipe.max_hours * 3600)
    return spec, devices


def run_recipe_local(recipe: Recipe, *, ledger: Ledger, echo: Callable[[str], None] | None,
                     on_start: Callable[[Run, str], None] | None = None) -> tuple[Run, RunResult]:
    """Run ``recipe`` on this machine (topology ``local``) and record it."""
    spec, devices = local_spec(recipe)
    run = new_run(ledger, recipe, provider="local", topology="local",
                  plan={"provider": "local", "topology": "local", "usd_per_hour": 0.0, "devices": devices})
    ledger.event(run.id, "cli", "start", f"local run of {recipe.name}: {devices}")
    if on_start:
        on_start(run, devices)
    result: RunResult | None = None
    try:
        result = run_local(spec, Path(run.run_dir or "."), echo=echo)
    finally:
        updated = end_run(ledger, run.id, result, status=result.status if result else "interrupted",
                          message=result.reason if result else "interrupted before the nodes finished")
    return updated, result


def plan_for_run(recipe: Recipe, provider: str | None) -> tuple["Plan", list["PlanOption"]]:
    """Plan ``recipe`` over every provider (``provider`` None) or one, and return the plan and the ranked valid
    options broker can act on: this machine, or clouds whose credentials are configured (a snapshot price cannot
    be rented).  Raises NoValidPlan (exit 3) naming the cheapest rejected options, or the credentials needed.
    """
    from broker.facts import DEFAULT_PROVIDERS, gather
    from broker.planner import plan as make_plan
    from broker.providers import get_provider

    req = recipe.requirements()
    names = [provider] if provider else list(DEFAULT_PROVIDERS)
    facts = gather(req, names)
    plan = make_plan(req, facts.offers, facts.quotas, facts.capacities, notes=facts.notes,
                     unavailable=facts.unavailable)
    if plan.chosen is None:
        reasons = "; ".join(f"{o.provider} {o.topology.value} {o.summary}: {o.rejected[0]}"
                            for o in plan.rejected[:4] if o.rejected)
        raise NoValidPlan(f"no valid way to run {recipe.name} ({recipe.nodes} node(s) x {recipe.gpus_per_node} GPU, "
                          f"budget ${recipe.budget_usd:g}, deadline {recipe.max_hours:g} h): {reasons}",
                          hint=f"`broker plan --recipe {recipe.path}` shows every option; raise budget_usd, lower "
                               "max_hours, accept more GPU models, or set cpu_ok: true for a CPU logic check here")
    usable: list = []
    missing: dict[str, str] = {}
    for opt in plan.options:
        if opt.provider == "local":
            usable.append(opt)
            continue
        if opt.provider not in missing:
            try:
                chk = get_provider(opt.provider).check()
                missing[opt.provider] = "" if chk.configured else (chk.hint or chk.detail or "no credentials")
            except Exception as e:  # noqa: BLE001 - an adapter that cannot start cannot rent
                missing[opt.provider] = str(e)
        if not missing[opt.provider]:
            usable.append(opt)
    if not usable:
        best = plan.chosen
        if provider:
            raise AuthError(provider, "credentials check", f"no credentials: the plan on {provider} comes from a "
                            "price snapshot and nothing can be rented", hint=missing.get(provider) or None)
        need = "; ".join(f"{p}: {why}" for p, why in missing.items() if why)
        cpu = "" if recipe.cpu_ok else "; or set cpu_ok: true in the recipe to run a CPU logic check on this machine"
        raise NoValidPlan(f"the cheapest plan is {best.topology.value} on {best.provider} ({best.summary}, worst case "
                          f"${best.worst_case_usd:.2f}) but no provider with credentials can serve {recipe.name}",
                          hint=f"configure one (see .env.example): {need}{cpu}")
    return plan, usable
