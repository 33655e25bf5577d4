"""Silent wrong results: what the rank shim recorded inside each rank of a run whose ranks all exited 0, judged
at the end -- every rank on the whole dataset, samplers built for another world size or never given set_epoch, one
path written by several ranks, replicas that drifted apart (parameter checksums), and a rank that skipped
backward() for a batch.  :func:`sanity_warnings` is the entry point (:func:`broker.run.diagnose.explain` calls it)."""

from __future__ import annotations

import os
from typing import Any


def sanity_warnings(facts: list[dict[str, Any]]) -> list[str]:
    """Warnings for a run that succeeded but may have trained wrong, from the shim's DDP sanity record (``data``
    in each rank's facts): every rank iterated the whole dataset (no DistributedSampler), a DistributedSampler
    without set_epoch over several epochs (the same order every epoch), one torch.save path written by several
    ranks.  Empty when the facts hold no such record (a script without DataLoader, or older facts)."""
    ranks = [d for d in facts if isinstance(d.get("data"), dict) and d.get("rank") is not None]
    world = max([int(d.get("world_size") or 1) for d in facts] or [1])
    if world < 2:
        return []
    out: list[str] = drift_warnings(facts)
    if not ranks:
        return out
    full: dict[int, int] = {}
    for d in ranks:
        for ld in d["data"].get("loaders") or []:
            n, sampler = ld.get("dataset_len"), str(ld.get("sampler"))
            if not n or "Distributed" in sampler or not ld.get("passes"):
                continue
            if (ld.get("samples") or 0) / ld["passes"] >= n:
                full[d["rank"]] = n
    if len(full) == len(ranks) == world:
        n = max(full.values())
        out.append(f"every rank saw all {n} samples of its DataLoader (no DistributedSampler): if that is the "
                   f"training data, the {world} ranks trained on the same samples and the run did the work of one "
                   "rank; use sampler=DistributedSampler(dataset) in the DataLoader (and no shuffle=True there)")
    out.extend(_coverage_warnings(ranks, world))
    no_epoch = [d["rank"] for d in ranks if not d["data"].get("set_epoch") and any(
        "Distributed" in str(ld.get("sampler")) and (ld.get("passes") or 0) > 1 for ld in d["data"].get("loaders") or [])]
    if no_epoch:
        passes = max((ld.get("passes") or 0) for d in ranks for ld in d["data"].get("loaders") or [])
        out.append(f"DistributedSampler.set_epoch was never called on rank(s) {', '.join(map(str, no_epoch))} over "
                   f"{passes} epochs: every epoch used the same order; call sampler.set_epoch(epoch) at the start of "
                   "each epoch")
    out.extend(_epoch_warnings(ranks))
    writers: dict[str, list[int]] = {}
    for d in ranks:
        for path in d["data"].get("saved") or []:
            writers.setdefault(str(path), []).append(d["rank"])
    for path, rs in sorted(writers.items()):
        if len(rs) > 1:
            out.append(f"ranks {', '.join(map(str, sorted(rs)))} all wrote {path} with torch.save: on shared "
                       "storage they overwrite each other (a torn file), on separate disks every node keeps its own "
                       "copy; save from one rank: `if dist.get_rank() == 0: torch.save(...)`")
    return out


def _at(at: Any) -> str:
    return f"{os.path.basename(str(at.get('file')))}:{at.get('line')}" if isinstance(at, dict) and at.get("file") else "?"


def _fed_samplers(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The DistributedSamplers of one rank that a DataLoader iterated (a sampler no loader iterates does not
    count), each with that loader's passes."""
    samplers = d["data"].get("samplers") or []
    out = []
    for ld in d["data"].get("loaders") or []:
        i = ld.get("sampler_index")
        if isinstance(i, int) and 0 <= i < len(samplers) and ld.get("passes"):
            out.append(dict(samplers[i], passes=ld["passes"]))
    return out


def _coverage_warnings(ranks: list[dict[str, Any]], world: int) -> list[str]:
    """Samples the ranks' DistributedSamplers drew together, against the dataset: ``num_replicas`` or ``rank``
    given to the sampler that differ from the job's."""
    fed = {d["rank"]: _fed_samplers(d) for d in ranks}
    if not all(fed.values()) or len(fed) < world:
        return []
    first = {r: s[0] for r, s in fed.items()}  # the first loader each rank iterated: the training one
    n = max((s.get("dataset_len") or 0) for s in first.values())
    reps = {s.get("num_replicas") for s in first.values()}
    seen_ranks = {s.get("rank") for s in first.values()}
    if not n or (reps == {world} and len(seen_ranks) == world):
        return []
    drawn = min(n, sum(int(s.get("num_samples") or 0) for s in {s.get("rank"): s for s in first.values()}.values()))
    s0 = first[min(first)]
    why = []
    if reps != {world}:
        why.append(f"num_replicas={'/'.join(map(str, sorted(reps, key=str)))} in a {world}-rank job")
    if len(seen_ranks) < world:
        why.append(f"the samplers were given rank(s) {', '.join(map(str, sorted(seen_ranks, key=str)))} on "
                   f"{world} ranks")
    return [f"together the ranks drew {drawn} of {n} samples per epoch because {' and '.join(why)} "
            f"({_at(s0.get('at'))}): build it as DistributedSampler(dataset) (it reads the world size and rank "
            "from the process group)"]


def _epoch_warnings(ranks: list[dict[str, Any]]) -> list[str]:
    """``set_epoch`` called on another sampler than the one that feeds training (so the old whole-run count saw
    calls and said nothing)."""
    for d in ranks:
        fed = [s for s in _fed_samplers(d) if s.get("shuffle") and (s.get("passes") or 0) > 1]
        if not fed or fed[0].get("epochs"):
            continue
        other = [s for s in d["data"].get("samplers") or [] if s.get("epochs")]
        if other:
            return [f"set_epoch is never called on the sampler that feeds training ({_at(fed[0].get('at'))}, "
                    f"{fed[0]['passes']} epochs: the same order every epoch); {_at(other[0].get('set_epoch_at'))} "
                    f"calls it on another one (built at {_at(other[0].get('at'))}): call it on the training "
                    "loader's sampler"]
    return []


def drift_warnings(facts: list[dict[str, Any]]) -> list[str]:
    """Replicas that drifted apart: the parameter checksums each rank wrote at its clean end (the DDP-wrapped
    modules, else the optimizers' parameters) compared across ranks, with the likely cause from the facts."""
    ranks = sorted((d for d in facts if isinstance(d.get("checksums"), list) and d.get("rank") is not None),
                   key=lambda d: d["rank"])
    if len(ranks) < 2:
        return []
    base = ranks[0]
    out: list[str] = []
    for gi, g in enumerate(base["checksums"]):
        names = [row[0] for row in g.get("sums") or []]
        differ: list[str] = []
        for other in ranks[1:]:
            if gi >= len(other["checksums"]):
                continue
            og = {row[0]: row for row in other["checksums"][gi].get("sums") or []}
            for row in g.get("sums") or []:
                o = og.get(row[0])
                if o is None:
                    continue
                if any(abs(a - b) > 1e-6 * (1 + abs(a)) for a, b in zip(row[1:3], o[1:3])):
                    if row[0] not in differ:
                        differ.append(row[0])
        if not differ:
            continue
        what = "DDP-wrapped parameters" if g.get("from") == "ddp" else "parameters the optimizers update"
        first = differ[0]
        vals = ", ".join(f"rank {d['rank']}: {next((row[1] for row in d['checksums'][gi]['sums'] if row[0] == first), float('nan')):.6g}"
                         for d in ranks if gi < len(d["checksums"]))
        out.append(f"the replicas drifted apart: {len(differ)} of {len(names)} {what} differ between the ranks at "
                   f"the end ({', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}; sum of {first}: {vals}); "
                   f"{_drift_cause(ranks, g.get('from'))}")
    return out


def skipped_backward(facts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank(s) that skipped ``backward()`` after a forward of the DDP model more often than the others (the
    shim's ``ddp.skipped``: a synced forward followed by another, or by the end, with no backward between them),
    as a divergence (``{"index", "left", "by_rank", "skipped", "counts", "line"}``, the shape of
    :func:`broker.run.stall.sequence_divergence`'s answer); None when every rank skipped as often (an evaluation
    forward with gradients on every rank is no divergence)."""
    ranks = {d["rank"]: d.get("ddp") or {} for d in facts if d.get("rank") is not None and isinstance(d.get("ddp"), dict)}
    if len(ranks) < 2:
        return None
    n = {r: int(c.get("backwards_skipped") or 0) for r, c in ranks.items()}
    low = min(n.values())
    left = sorted(r for r, v in n.items() if v > low)
    fwd = {r: [s.get("forward") for s in c.get("skipped") or [] if isinstance(s, dict)] for r, c in ranks.items()}
    if left:
        skips = [s for s in ranks[left[0]].get("skipped") or [] if isinstance(s, dict)]
        first = skips[low] if low < len(skips) else (skips[0] if skips else {})
    else:  # as many skips on every rank, but after different forwards: the all-reduces between paired other batches
        odd = [f for fs in fwd.values() for f in fs if isinstance(f, int) and not all(f in o for o in fwd.values())]
        if not odd:
            return None
        left = sorted(r for r, fs in fwd.items() if min(odd) in fs)
        first = next(s for s in ranks[left[0]]["skipped"] if isinstance(s, dict) and s.get("forward") == min(odd))
    index = int(first.get("points") or 0) + 1
    at = first.get("at") if isinstance(first.get("at"), dict) else None
    where = (f"after its forward #{first.get('forward', '?')} of the DDP model (the next forward, at {_at(at)}, "
             "came with no backward() between them)") if at else \
        f"after its last forward of the DDP model (#{first.get('forward', '?')}, no backward() before the end)"
    bw = {r: (c.get("backwards_synced") or 0) for r, c in ranks.items()}
    by_rank: dict[int, Any] = {}
    for d in facts:
        seq = d.get("seq") if isinstance(d.get("seq"), dict) else {}
        try:
            sig = seq["sigs"][seq["seq"][index - 1]]
        except (KeyError, IndexError, TypeError):
            sig = None
        if d.get("rank") is not None:
            by_rank[d["rank"]] = tuple(sig) if sig else None
    from broker.run.sequences import _sig_text

    others = "; ".join(f"rank {r} made {_sig_text(by_rank.get(r))}" for r in sorted(ranks) if r not in left)
    if len(set(n.values())) > 1:
        after = ("from there the ranks' gradient all-reduces pair off by one ("
                 + ", ".join(f"rank {r}: {v} synchronised backward() calls" for r, v in sorted(bw.items())) + ")")
    else:
        after = ("every rank skipped as often, after different forwards ("
                 + ", ".join(f"rank {r}: #{', #'.join(map(str, fs))}" for r, fs in sorted(fwd.items()))
                 + "), so the gradient all-reduces in between averaged different batches of each rank")
    line = (f"rank(s) {', '.join(map(str, left))} left the ranks' common path at collective #{index}: skipped "
            f"backward() {where}, where {others or 'the others made none'}; {after}")
    return {"index": index, "left": left, "by_rank": by_rank, "skipped": first, "counts": n, "line": line}


def _drift_cause(ranks: list[dict[str, Any]], source: str | None) -> str:
    skipped = skipped_backward(ranks)
    if source == "ddp" and skipped is not None:
        return "likely cause: " + skipped["line"] + "; call backward() on every rank for every batch"
    ddp = [d.get("ddp") or {} for d in ranks]
    if source == "ddp" and ddp and all(c.get("forwards_no_sync") and not c.get("forwards_synced") for c in ddp):
        return (f"likely cause: every forward ran inside no_sync() ({ddp[0].get('forwards_no_sync')} on rank "
                f"{ranks[0]['rank']}), so the gradients were never all-reduced; run the last micro-step of each "
                "accumulation outside `with model.no_sync():`")
    bw = {d["rank"]: (d.get("ddp") or {}).get("backwards_synced") for d in ranks}
    if source == "ddp" and len(set(bw.values())) > 1:
        return ("likely cause: the ranks ran different numbers of synchronised backward() calls ("
                + ", ".join(f"rank {r}: {n}" for r, n in bw.items()) + "): a rank skipped backward() for a batch")
    if source != "ddp":
        ops = [[str(sig[0]) for sig in (d.get("seq") or {}).get("sigs") or []] for d in ranks]
        if not any("broadcast" in op for o in ops for op in o):
            return ("likely cause: the initial weights were never broadcast (no DDP, and no broadcast in any rank's "
                    "collectives): each rank started from its own random weights; broadcast every parameter from "
                    "rank 0 before training (`dist.broadcast(p.data, src=0)`), or wrap the model in "
                    "DistributedDataParallel")
    return "the ranks' updates differed (a rank skipped a step, or gradients were not averaged on every rank)"
