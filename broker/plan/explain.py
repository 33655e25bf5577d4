"""Why there is no plan, in words a user can act on (pure: no I/O).

:func:`no_plan_error` turns a :class:`~broker.core.model.Plan` without a chosen option into the :class:`NoValidPlan`
(exit 3) that ``broker run`` raises.  When the budget is what rejects the options that meet everything else, the
message says so first: the cheapest such option's worst case against the budget, and how many hours of it the
budget affords; the hint names only changes that would help and that the recipe does not already have (never
"set cpu_ok: true" when it is set).
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from broker.core.model import Plan, PlanOption, Rejection, RejectionKind
from broker.core.prose import cents_up, usd
from broker.core.provider import NoValidPlan


def _num(x: float) -> str:
    return f"{x:g}"


def is_budget_reason(r: Rejection) -> bool:
    """Whether a rejection is the budget's (worst case over the budget, or a budget that affords no run): read
    from its kind, never from its words."""
    return getattr(r, "kind", None) is RejectionKind.budget


def _no_gpu_here(r: Rejection) -> bool:
    """Whether a rejection is "this machine has no GPU", which gloo on CPU (``cpu_ok``) would lift."""
    return getattr(r, "lifted_by", None) == "cpu_ok"


def budget_only(plan: Plan) -> list[PlanOption]:
    """Rejected options that only the budget rejects (they meet GPU, topology, capacity and quota), cheapest
    worst case first."""
    out = [o for o in plan.rejected if o.rejected and all(is_budget_reason(r) for r in o.rejected)]
    return sorted(out, key=lambda o: (o.worst_case_usd, o.usd_per_hour))


def budget_sentence(plan: Plan, budget_usd: float | None, *, flags: bool = False) -> tuple[str, list[str]] | None:
    """(sentence, hint parts) when the budget is the limit, else None.

    E.g. "the budget is the limit: the cheapest option that meets everything else, 1x RTX 3090 (vast) at
    $0.20/h, has a worst case of $0.12 for 0.5 h (setup included) > budget $0.05; the budget affords 0.08 h of
    it"; hints "raise budget_usd to at least $0.12", "or set max_hours: 0.08".
    """
    if budget_usd is None:
        return None
    from broker.plan.planner import digits_note

    cands = budget_only(plan)
    if not cands:
        return None
    o = cands[0]
    what = f"{o.summary} on {o.provider}" if o.offers else f"{o.topology.value} on {o.provider}"
    s = (f"the budget is the limit: the cheapest option that meets everything else, {what} at "
         f"{usd(o.usd_per_hour)}/h, has a worst case of {usd(o.worst_case_usd, budget_usd)} for "
         f"{_num(round(o.hours, 2))} h (setup included) > budget {usd(budget_usd)}"
         f"{digits_note(o.worst_case_usd, budget_usd)}")
    need = cents_up(o.worst_case_usd)
    # ``flags``: the job came from command-line flags (`broker run SCRIPT.py`): the hint is the flag to pass
    hints = [f"add --budget {need:.2f}" if flags else f"raise budget_usd to at least {usd(need)}"]
    from broker.plan.planner import MIN_RUN_SECONDS

    fit = o.max_hours_within_budget
    if fit is not None and fit * 3600.0 >= MIN_RUN_SECONDS:
        fit_h = math.floor(fit * 100) / 100
        s += f"; the budget affords {_num(fit_h)} h ({fit * 60:.0f} min) of it"
        if MIN_RUN_SECONDS <= fit_h * 3600.0 and fit_h < o.hours:
            hints.append(f"or --hours {_num(fit_h)}" if flags else f"or set max_hours: {_num(fit_h)}")
    else:
        s += "; the budget affords no run of it (setup alone costs more)"
    return s, hints


def _other_reasons(plan: Plan, limit: int = 3) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for o in plan.rejected:
        if not o.rejected or all(is_budget_reason(r) for r in o.rejected):
            continue
        r = next(x for x in o.rejected if not is_budget_reason(x))
        key = r.split(";")[0][:60]
        if key in seen:
            continue
        seen.add(key)
        out.append(f"{o.provider} {o.topology.value}{' ' + o.summary if o.offers else ''}: {r}")
        if len(out) >= limit:
            break
    return out


#: how the facts' note begins when no provider offers the GPU model asked for (plan.facts writes it)
NO_OFFER_FOR_MODEL = "no offer has GPU model"


def _first_reasons(plan: Plan) -> list[Rejection]:
    return [o.rejected[0] for o in plan.rejected if o.rejected]


#: how a hint names the budget, the deadline and cpu_ok when the recipe set them (:func:`no_plan_hints`)
FIELD_WORDS = {"budget": "budget_usd", "hours": "max_hours", "cpu_ok": "set cpu_ok: true in the recipe"}
#: ... and when command-line flags set them (``broker plan --budget 0.1`` without a recipe)
FLAG_WORDS = {"budget": "--budget", "hours": "--hours", "cpu_ok": "add --cpu-ok"}


def no_plan_hints(plan: Plan, *, cpu_ok: bool, budget_given: bool,
                  words: dict[str, str] | None = None) -> list[str]:
    """What to change when no option is valid, following the rejection reasons (not a blanket "relax the job,
    raise the budget or request quota"): only GPU-model rejections name the models that are offered; only "this
    machine has no GPU" says --cpu-ok; otherwise one hint per reason kind that occurred.  ``cpu_ok``: whether the
    job already allows gloo on CPU (its hint is then left out); ``budget_given``: whether a budget was set;
    ``words``: how the user set the budget, the deadline and cpu_ok (:data:`FIELD_WORDS`, the default, or
    :data:`FLAG_WORDS`, key by key)."""
    w = {**FIELD_WORDS, **(words or {})}
    counts = plan.rejected_counts or {}
    firsts = _first_reasons(plan)
    no_gpu_here = [r for r in firsts if _no_gpu_here(r)]
    cpu_hint = "this machine has no GPU: add --cpu-ok (recipe: cpu_ok: true) for a gloo-on-CPU logic check"
    unknown_model = next((n.split(";")[0] for n in plan.notes if n.startswith(NO_OFFER_FOR_MODEL)), None)
    if unknown_model and firsts and len(no_gpu_here) == len(firsts):
        # only this machine was left to judge because the model named matches no offer anywhere: the name is
        # the cause (a typo such as "RTX 4900"), not the missing --cpu-ok
        return [f"{unknown_model}: check the name (`broker offers` lists the models offered)"]
    if firsts and len(no_gpu_here) == len(firsts) and not cpu_ok:
        return [cpu_hint]
    kinds = {k for k, n in counts.items() if n and k != "provider"}
    if kinds == {"gpu-model"}:
        wanted = ", ".join(plan.requirements.gpu_names) or "the models asked for"
        offered = sorted({x.gpu_name for o in plan.rejected for x in o.offers
                          if o.rejected and o.rejected[0].kind is RejectionKind.gpu_model})
        out = [f"no offer has GPU model {wanted}; offered here: {', '.join(offered)} (`broker offers` lists them "
               "all): name one of those in gpu.models (or --gpu)" if offered else
               f"no offer has GPU model {wanted}: `broker offers` lists the models offered"]
        if no_gpu_here and not cpu_ok:
            out.append(cpu_hint)
        return out
    hints: list[str] = []
    if counts.get("budget") and budget_given:
        hints.append(f"raise {w['budget']} or lower {w['hours']}")
    if counts.get("gpu-model") or counts.get("gpu-memory"):
        hints.append("accept more GPU models (gpu.models) or less GPU memory")
    if counts.get("quota"):
        hints.append("raise the quota (`broker plan` prints the `broker quota request ...` command)")
    if counts.get("capacity"):
        hints.append("try later or other regions / zones")
    if kinds == {"topology"}:
        # only the topology blocks: its own reason says what would serve it (e.g. which providers can host the
        # cloud side of a hybrid run); a reason cpu_ok lifts gets the cpu_ok hint below instead
        topo = list(dict.fromkeys(r.text for o in plan.rejected for r in o.rejected
                                  if getattr(r, "kind", None) is RejectionKind.topology and not r.lifted_by))
        hints += topo[:2]
    if not cpu_ok and any(_no_gpu_here(r) for o in plan.rejected for r in o.rejected):
        hints.append(f"{w['cpu_ok']} for a gloo-on-CPU logic check on this machine")
    return hints


def no_plan_error(recipe: Any, plan: Plan) -> NoValidPlan:
    """The NoValidPlan for a plan without a chosen option.  ``recipe``: the Recipe (``name``, ``nodes``,
    ``gpus_per_node``, ``budget_usd``, ``max_hours``, ``cpu_ok``, ``path`` are read when present)."""
    name = getattr(recipe, "name", "the job")
    budget = getattr(recipe, "budget_usd", None)
    hours = getattr(recipe, "max_hours", None)
    per_node = getattr(recipe, "gpus_per_node", "?")
    shape = ("CPU only (gloo)" if per_node == 0 and getattr(recipe, "cpu_ok", False) else f"x {per_node} GPU")
    head = (f"no valid way to run {name} ({getattr(recipe, 'nodes', '?')} node(s)"
            + ("," if shape.startswith("CPU") else "") + f" {shape}"
            + (f", budget {usd(budget)}" if budget is not None else "")
            + (f", deadline {_num(hours)} h" if hours is not None else "") + ")")
    parts: list[str] = []
    hints: list[str] = []
    from_flags = bool(getattr(recipe, "from_script", False))
    b = budget_sentence(plan, budget, flags=from_flags)
    if b:
        parts.append(b[0])
        hints += b[1]
    others = _other_reasons(plan)
    if others:
        parts.append(("other options: " if b else "") + "; ".join(others))
    if not b:
        hints += no_plan_hints(plan, cpu_ok=bool(getattr(recipe, "cpu_ok", False)), budget_given=budget is not None,
                               words=FLAG_WORDS if from_flags else None)
    path = getattr(recipe, "path", None)
    hints.append(f"`broker plan --recipe {shlex.quote(str(path))}` shows every option" if path
                 else "`broker plan` shows every option")
    return NoValidPlan(head + ": " + (". ".join(parts) if parts else "every option was rejected"),
                       hint="; ".join(hints))


def limit_words(recipe: object | None, budget: float | None, hours: float | None,
                cpu_ok: bool | None) -> dict[str, str]:
    """How the user set the budget, the deadline and cpu_ok, for hints (:data:`FLAG_WORDS` for
    a flag given or no recipe, else the recipe's field names).  ``recipe``: the recipe file, None = flags only."""
    given = {"budget": budget is not None, "hours": hours is not None, "cpu_ok": bool(cpu_ok)}
    return {k: FLAG_WORDS[k] if recipe is None or given[k] else FIELD_WORDS[k] for k in FIELD_WORDS}
