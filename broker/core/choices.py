"""Values of the command line's enum flags (``--provider``, ``--topology``, ``--mesh``): one rule for
every command: the exact value, the same value in another case (``LOCAL``), or an error that names the closest
valid value (``vasti``: did you mean 'vast'?) and lists them all.  No I/O; imports nothing heavy."""

from __future__ import annotations

from typing import Iterable

#: the run topologies a flag may name (broker.core.model's Topology plus ``any``: let the plan decide)
TOPOLOGIES = ("simulated", "multi-node", "local", "hybrid", "any")
#: the hybrid meshes (broker.run.hybrid.MESHES)
MESHES = ("wireguard", "tailscale")


def provider_names() -> tuple[str, ...]:
    """Every provider name of the registry (broker.providers.REGISTRY: the import is a dict, no adapter)."""
    from broker.providers import names

    return tuple(names())


def _squash(s: str) -> str:
    return s.lower().replace("-", "").replace("_", "")


def closest(value: str, choices: Iterable[str]) -> str | None:
    """The valid value ``value`` most likely meant (a typo, a missing hyphen), or None when none is close."""
    choices = list(choices)
    by_squash = {_squash(c): c for c in choices}
    if _squash(value) in by_squash:
        return by_squash[_squash(value)]
    import difflib  # only on a miss: broker's start-up never pays for it

    hit = difflib.get_close_matches(_squash(value), list(by_squash), n=1, cutoff=0.6)
    return by_squash[hit[0]] if hit else None


def pick(flag: str, value: str, choices: Iterable[str], *, what: str, extra_hint: str = "") -> str:
    """``value`` as one of ``choices``: itself, or the choice equal to it ignoring case.  Raises BadInput (exit 2)
    naming ``flag``, the closest choice (did you mean) and every choice."""
    choices = tuple(choices)
    if value in choices:
        return value
    same_case = [c for c in choices if c.lower() == value.lower()]
    if len(same_case) == 1:
        return same_case[0]
    from broker.core.errors import BadInput

    near = closest(value, choices)
    mean = f"did you mean {flag} {near}? " if near else ""
    raise BadInput(f"{flag} {value!r} is not {what}",
                   hint=f"{mean}choose one of: {', '.join(choices)}{extra_hint}")


#: flag -> (choices, what it names); ``-p`` is --provider in every command that has it
ENUM_FLAGS = {
    "--provider": (provider_names, "a provider"), "-p": (provider_names, "a provider"),
    "--topology": (lambda: TOPOLOGIES, "a topology"),
    "--mesh": (lambda: MESHES, "a mesh"),
}  # --inject: the pipeline's own message names the faults of the chosen topology

#: commands whose enum flags are checked before they run (``ssh``/``exec`` pass their words on untouched)
CHECKED_COMMANDS = ("run", "plan", "offers", "check", "catalog", "cost", "quota", "reconcile", "slurm", "netns")


def normalize_args(args: list[str]) -> list[str]:
    """``args`` with every enum flag's value made canonical (``--provider LOCAL`` -> ``local``); raises BadInput for
    a value no command accepts (with did-you-mean).  Words after ``--`` and commands not in
    :data:`CHECKED_COMMANDS` are left alone; what a given command accepts (a narrower set) it checks itself."""
    stop = args.index("--") if "--" in args else len(args)
    first = next((a for a in args[:stop] if not a.startswith("-")), None)
    if first not in CHECKED_COMMANDS:
        return args
    out = list(args)
    i = 0
    while i < stop:
        a = out[i]
        flag, value, at = a, None, None
        if a == "-p" and first == "slurm":  # `broker slurm ... -p` is the Slurm partition there
            i += 1
            continue
        if "=" in a and a.startswith("--") and a.split("=", 1)[0] in ENUM_FLAGS:
            flag, value = a.split("=", 1)
        elif a in ENUM_FLAGS and i + 1 < stop and not out[i + 1].startswith("-"):
            value, at = out[i + 1], i + 1
        if value is not None and flag in ENUM_FLAGS:
            choices, what = ENUM_FLAGS[flag]
            name = "--provider" if flag == "-p" else flag
            known = choices()
            if what == "a provider" and value not in known:  # an installed plug-in: read only for a name not here
                from broker.providers import plugins

                known = (*known, *plugins())
            canon = pick(name, value, known, what=what)
            if at is None:
                out[i] = f"{flag}={canon}"
            else:
                out[at] = canon
                i += 1
        i += 1
    return out
