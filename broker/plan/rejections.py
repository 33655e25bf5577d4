"""The rejected options of a plan: their reason kinds, the "N options rejected" note, and how the rejections of
several planning passes (on-demand and interruptible) are shown as one.  Pure; imports nothing of its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from broker.core.model import PlanOption, RejectionKind

#: Reason kinds in check order (keys of ``Plan.rejected_counts``): the planner's :class:`RejectionKind` values.
REASON_KINDS = tuple(k.value for k in RejectionKind if k is not RejectionKind.other)


def rejected_note(counts: Mapping[str, int], shown: int, per_reason: int) -> str:
    """``"78 options rejected (provider 1, topology 41, budget 36); showing the cheapest 5 per reason"`` from a
    plan's ``rejected_counts`` when more were rejected than the ``shown`` representatives; else ``""``."""
    n_rej = sum(counts.values())
    if n_rej <= shown:
        return ""
    by = ", ".join(f"{k} {counts[k]:,}" for k in REASON_KINDS if counts.get(k))
    return f"{n_rej:,} options rejected ({by}); showing the cheapest {per_reason} per reason"


def merge_rejected(groups: Iterable[list[PlanOption]], per_reason: int) -> list[PlanOption]:
    """The rejected options of several planning passes as one pass shows them: per reason kind (in
    :data:`REASON_KINDS` order; an option without one counts as ``budget``) the ``per_reason`` cheapest by worst
    case, the earlier group first at equal cost."""
    by_kind: dict[str, list[PlanOption]] = {}
    for g in groups:
        for o in g:
            by_kind.setdefault(o.reason_kind or "budget", []).append(o)
    order = [*REASON_KINDS, *sorted(k for k in by_kind if k not in REASON_KINDS)]
    out: list[PlanOption] = []
    for k in order:
        out += sorted(by_kind.get(k, ()), key=lambda o: o.worst_case_usd)[:per_reason]
    return out


def with_counts(notes: list[str], old: Mapping[str, int], old_shown: int, counts: Mapping[str, int], shown: int,
                per_reason: int) -> list[str]:
    """``notes`` with one pass's "N options rejected" note (``old`` counts, ``old_shown`` rows) replaced by the
    note of the merged ``counts`` and ``shown`` rows."""
    stale = rejected_note(old, old_shown, per_reason)
    out = [n for n in notes if not (stale and n == stale)]
    note = rejected_note(counts, shown, per_reason)
    if note:
        out.append(note)
    return out
