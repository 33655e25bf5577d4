"""The one place for the bounds of a job's numbers: recipes (:mod:`broker.core.recipe`) and the ``plan`` flags both
check against these, so a flag can never ask for what a recipe may not.

Pure and free of third-party imports (the CLI checks its flags with :func:`check_number` before loading pydantic).
"""

from __future__ import annotations

import math

from broker.core.errors import BadInput

#: field -> (lowest, highest, lowest is exclusive, unit / what it is, example).  Highest is always inclusive.
LIMITS: dict[str, tuple[float, float, bool, str, str]] = {
    "nodes": (1, 64, False, "nodes", "2"),
    "gpus_per_node": (0, 16, False, "GPUs per node (0 = a CPU-only job)", "1"),
    "budget_usd": (0, 100_000, True, "US dollars", "5"),
    "max_hours": (0, 168, True, "hours (one week at most)", "0.5"),
    "min_mem_gib": (0, 1024, False, "GiB per GPU", "16"),
    "disk_gib": (0, 65_536, True, "GiB per node", "40"),
    "idle_minutes": (0, 10_080, True, "minutes", "30"),
}

#: fields that take whole numbers only
INTEGER_FIELDS = ("nodes", "gpus_per_node")

#: the most ``*`` aliases a recipe may use, and the most nodes (after aliases are expanded) its YAML may hold
MAX_YAML_ALIASES = 64
MAX_YAML_NODES = 20_000
#: the deepest nesting of lists/mappings a recipe may hold
MAX_YAML_DEPTH = 50


def plain(value: float | int) -> str:
    """A number as people write it in a message: whole numbers in full (``1000000000``, never ``1e+09``), others
    in their shortest exact form with a plain exponent only when huge or tiny (``0.5``, ``1e300``, ``1e-7``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    f = float(value)
    if not math.isfinite(f):
        return str(f)
    if f.is_integer() and abs(f) < 1e16:
        return str(int(f))
    text = repr(f)
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant.removesuffix('.0')}e{int(exp)}"
    return text


def allowed(field: str, example: bool = True) -> str:
    """What is allowed for ``field``, in words: ``a whole number from 1 to 64``; ``example`` False leaves out the
    trailing ``e.g. 5`` (where the hint already gives one)."""
    lo, hi, open_lo, unit, ex = LIMITS[field]
    if field in INTEGER_FIELDS:
        return f"a whole number from {plain(lo)} to {plain(hi)}"
    low = f"more than {plain(lo)}" if open_lo else f"at least {plain(lo)}"
    return f"a number of {unit}, {low} and at most {plain(hi)}" + (f", e.g. {ex}" if example else "")


def problem(field: str, value: float | int) -> str | None:
    """Why ``value`` is not allowed for ``field`` (None when it is)."""
    lo, hi, open_lo, _, _ = LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    if field in INTEGER_FIELDS and not float(value).is_integer():
        return f"{plain(value)} is not a whole number"
    if value < lo or (open_lo and value == lo) or value > hi:
        return f"{plain(value)} is out of range"
    return None


def check_number(flag: str, field: str, value: float | int | None) -> None:
    """Raise BadInput (exit 2) when the flag's ``value`` breaks the limit of ``field``; None passes."""
    if value is None:
        return
    why = problem(field, value)
    if why:
        raise BadInput(f"{flag} {why}: allowed is {allowed(field, example=False)}",
                       hint=f"e.g. {flag} {LIMITS[field][4]}")
