"""The ranks' sequences of sync points (the rank shim's ``seq`` facts: each collective, DDP's buffer broadcast and
gradient all-reduce, with the user's line) compared: where they first part and which rank left the common path."""

from __future__ import annotations

import json
import os
from typing import Any


def _expand(rec: Any) -> tuple[list[tuple], bool] | None:
    """A rank's recorded sequence as ``[(op, shape, file, line)]`` and whether it is whole (not cut at the cap)."""
    if not isinstance(rec, dict) or not isinstance(rec.get("sigs"), list) or not isinstance(rec.get("seq"), list):
        return None
    sigs = [tuple(json.dumps(x) if isinstance(x, list) else x for x in s) if isinstance(s, list) else (s,)
            for s in rec["sigs"]]
    try:
        seq = [sigs[i] for i in rec["seq"]]
    except (IndexError, TypeError):
        return None
    return seq, rec.get("total", len(seq)) == len(seq)


def _sig_text(sig: tuple | None) -> str:
    if sig is None:
        return "nothing"
    op, _shape, file, line = (list(sig) + [None] * 4)[:4]
    at = f" at {os.path.basename(str(file))}:{line}" if file else ""
    return f"{op}{at}"


def sequence_divergence(seqs: dict[int, Any]) -> dict[str, Any] | None:
    """Where the ranks' sequences of sync points (the shim's ``seq`` facts: collectives, DDP's buffer broadcast and
    gradient all-reduce, each with the user's line) first differ: ``{"index": k (1-based), "by_rank": {rank: sig
    or None}, "reached": [ranks with an entry at k], "short": [ranks whose sequence ended before k], "left":
    [ranks that left the common path], "line": text}``; None when they agree (or fewer than two ranks recorded
    one).  A rank *left the common path* when the step it took at k (previous entry -> this one) appears nowhere
    before k in any rank's sequence, while the others' step does: rank 0 evaluating through the DDP model while
    rank 1 trains, a rank that skipped backward(), a barrier under ``if rank == 0``."""
    got = {r: _expand(v) for r, v in seqs.items()}
    got = {r: v for r, v in got.items() if v is not None}
    if len(got) < 2:
        return None
    longest = max(len(s) for s, _ in got.values())
    k = None
    for i in range(longest):
        here = {r: (s[i] if i < len(s) else None) for r, (s, whole) in got.items()}
        if any(v is None and not got[r][1] for r, v in here.items()):
            return None  # a sequence cut at the cap: nothing to compare beyond it
        if len(set(here.values())) > 1:
            k = i
            break
    if k is None:
        return None
    by_rank = {r: (s[k] if k < len(s) else None) for r, (s, _) in got.items()}
    seen_steps = {(s[i - 1] if i else None, s[i]) for s, _ in got.values() for i in range(min(k, len(s)))}
    novel = sorted(r for r, (s, _) in got.items() if k < len(s) and ((s[k - 1] if k else None), s[k]) not in seen_steps)
    usual = [r for r, (s, _) in got.items() if k < len(s) and r not in novel]
    reached = sorted(r for r, v in by_rank.items() if v is not None)
    short = sorted(r for r, v in by_rank.items() if v is None)
    # only between ranks that all made a #k: when a rank's sequence simply ends there (it exited early, or waits
    # elsewhere), the rank that went on took a new step too, and nothing says which of them is at fault
    left = novel if novel and usual and not short and len({by_rank[r] for r in novel}) == 1 else []
    groups: dict[tuple, list[int]] = {}
    for r in reached:
        groups.setdefault(by_rank[r], []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} made {_sig_text(sig)}"
             for sig, rs in sorted(groups.items(), key=lambda kv: kv[1])]
    if short:
        parts.append(f"rank{'s' if len(short) > 1 else ''} {', '.join(map(str, short))} made only {k} "
                     f"(no #{k + 1})")
    line = f"the ranks' collective sequences part at #{k + 1}: " + "; ".join(parts)
    if left:
        line += (f"; rank{'s' if len(left) > 1 else ''} {', '.join(map(str, left))} left the common path there "
                 f"({_sig_text(by_rank[left[0]])} follows a step no rank took before)")
    return {"index": k + 1, "by_rank": by_rank, "reached": reached, "short": short, "left": left, "line": line}
