"""The plan step of a run: the pure planner over the providers' offers, quotas and capacity, and the ranked
valid options broker can act on.
"""

from __future__ import annotations

import shlex

from broker.core.model import Plan, PlanOption
from broker.core.prose import usd
from broker.core.provider import AuthError, BadInput, ProviderCheck, not_configured_error
from broker.core.recipe import Recipe, shown_path


# --------------------------------------------------------------------------------------------------- plan + entry
def local_choice_text(plan: Plan, recipe: Recipe) -> str:
    """What ``broker run`` says when this machine is the plan's choice.  The count is the plan's valid options,
    this machine included, as ``broker plan`` counts them ("N valid"); for a CPU-only job ``broker plan`` also adds
    the free-tier snapshot's $0.00 CPU offers, which a run never rents, so its count can be higher: said here."""
    valid = plan.valid_count or len(plan.options)
    if valid <= 1:
        return "plan: this machine (free) is the only valid option"
    cpu_only = recipe.gpus_per_node == 0 and recipe.cpu_ok
    extra = (" (for a CPU-only job it also counts the free-tier CPU offers, which a run does not rent)"
             if cpu_only else "")
    if recipe.path is None:  # `broker run SCRIPT.py`: no recipe file to name yet
        return (f"plan: this machine (free) is the cheapest of {valid} valid options; `broker plan --recipe FILE"
                f"{recipe.plan_flags()}` lists them (`broker run SCRIPT.py ... --save FILE` writes it){extra}")
    return (f"plan: this machine (free) is the cheapest of {valid} valid options; "
            f"`broker plan --recipe {shlex.quote(shown_path(recipe.path))}{recipe.plan_flags()}` lists them{extra}")


def plan_for_run(recipe: Recipe, provider: str | None) -> tuple[Plan, list[PlanOption]]:
    """Plan ``recipe`` over every provider (``provider`` None) or one, and return the plan and the ranked valid
    options broker can act on: this machine, or clouds whose credentials are configured (a snapshot price cannot
    be rented).  Raises NoValidPlan (exit 3) naming the cheapest rejected options when no option fits; AuthError
    (exit 4, a provider that is not configured) naming the credentials needed when options fit but none of them is
    on a provider with credentials.
    """
    from broker.plan.facts import DEFAULT_PROVIDERS, gather, log_plan
    from broker.plan.planner import plan as make_plan
    from broker.providers import capability, get_provider

    req = recipe.requirements()
    names = [provider] if provider else list(DEFAULT_PROVIDERS)
    facts = gather(req, names)
    plan = make_plan(req, facts.offers, facts.quotas, facts.capacities, notes=facts.notes, here=facts.here,
                     unavailable=facts.unavailable)
    log_plan(plan)
    if plan.chosen is None:
        from broker.plan.explain import no_plan_error

        raise no_plan_error(recipe, plan)
    usable: list = []
    missing: dict[str, ProviderCheck | None] = {}  # provider -> its failed check (None: configured)
    for opt in plan.options:
        if not capability(opt.provider, "rents"):  # a machine nobody rents (this one) needs no credentials
            usable.append(opt)
            continue
        if opt.provider not in missing:
            try:
                chk = get_provider(opt.provider).check()
            except BadInput:  # a setting of the user's that the adapter refuses: said as such (exit 2)
                raise
            except Exception as e:  # noqa: BLE001 - an adapter that cannot start cannot rent
                chk = ProviderCheck(provider=opt.provider, configured=False, detail=str(e))
            missing[opt.provider] = None if chk.configured else chk
        if missing[opt.provider] is None:
            usable.append(opt)
    if not usable:
        best = plan.chosen
        if provider:
            failed = missing.get(provider) or ProviderCheck(provider=provider, configured=False)
            raise not_configured_error(failed, f"the plan on {provider} comes from a price snapshot and nothing "
                                       "can be rented")
        # each provider's cause (its check's detail) and its fix, as `broker check` prints them
        need = "; ".join(p + (f" ({c.detail})" if c.detail and c.hint else "")
                         + f": {c.hint or c.detail or 'no credentials'}" for p, c in missing.items() if c)
        cpu = "" if recipe.cpu_ok else ("; or add --cpu-ok" if recipe.from_script else "; or set cpu_ok: true in "
                                        "the recipe") + " to run a CPU logic check on this machine"
        # a plan exists; what stops the run is providers that are not configured: exit 4, as with --provider
        raise AuthError(", ".join(p for p, c in missing.items() if c), "credentials check",
                        f"the cheapest plan is {best.topology.value} on {best.provider} ({best.summary}, worst case "
                        f"{usd(best.worst_case_usd)}) but no provider with credentials can serve {recipe.name}"
                        f"{interruptible_excludes_here(recipe)}",
                        hint=f"configure one (see .env.example): {need}{cpu}{free_try_hint(recipe)}")
    return plan, usable


def interruptible_excludes_here(recipe: Recipe) -> str:
    """The clause that says why this machine is not among the options of an ``interruptible: true`` recipe (it is
    never interruptible capacity, so the plan leaves it out), with the two ways to run it here; ``""`` for other
    recipes (``auto`` and ``false`` accept this machine)."""
    if str(getattr(recipe, "interruptible", "false")).lower() != "true":
        return ""
    return ("; this machine is never interruptible, so `interruptible: true` rules it out: "
            "`--interruptible false` or `--provider local` runs it here")


def free_try_hint(recipe: Recipe) -> str:
    """The end of the no-credentials hint: the free ways to try ``recipe`` without a cloud account (``--provider
    local`` on this machine for a CPU-capable recipe; ``broker plan`` for what renting would cost), ``""`` when
    there is no recipe file to name."""
    if recipe.path is None:
        return ""
    path = shlex.quote(shown_path(recipe.path))  # as the user typed it when under the current folder
    spot = str(getattr(recipe, "interruptible", "false")).lower() in ("true", "auto")
    flags = recipe.plan_flags()  # the flags that made this situation
    out = ""
    if recipe.cpu_ok:
        out += (f"; to try it free here: `broker run {path} --provider local{flags}`"
                + (" (on this machine nothing is preempted)" if spot else ""))
    out += (f"; `broker plan --recipe {path}{flags}` shows " + ("the interruptible option, its price" if spot else
                                                                 "every option, its price") + " and what it needs")
    return out


def local_interruptible_note(recipe: Recipe, where: str = "this machine") -> str:
    """The one line ``broker run --provider local`` (or ``netns``: ``where`` names its emulated hosts) says for a
    recipe that asks for interruptible capacity (this machine is never taken back, so there is no preemption, bid
    or restart); ``""`` otherwise."""
    # ``auto`` accepts on-demand capacity, which this machine is: only ``true`` asked for something not given
    if str(getattr(recipe, "interruptible", "false")).lower() != "true":
        return ""
    return (f"interruptible: true does not apply on {where}: nothing takes it back, so the run goes on without "
            "preemption, bids or restarts")


def no_hybrid_here(provider: str) -> BadInput:
    """The error for ``--topology hybrid`` on ``provider``, a provider that can neither emulate the hybrid
    topology nor rent its cloud side, naming those that can (from the registry's capabilities)."""
    from broker.providers import HYBRID_CLOUD, names_where

    emulated = names_where(lambda c: "hybrid" in c.topologies and not c.rents)
    return BadInput(f"--topology hybrid does not apply to --provider {provider}",
                    hint=f"--provider {' or '.join(emulated)} emulates it here; {' or '.join(HYBRID_CLOUD)} rent "
                    "the cloud side")
