"""The words of a recipe's ``interruptible`` field and of the ``--interruptible`` flag: what each reads as, the
refusal of any other value (one style for the field and the flag) and the warning for interruptible capacity
without a ``checkpoint_dir``.  Re-exported by :mod:`broker.core.recipe`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.core.errors import BadInput

#: every word ``interruptible`` takes, in a recipe and after ``--interruptible``, and the value it reads as (YAML 1.1
#: reads yes/no/on/off as booleans in a recipe, so the flag takes them too)
INTERRUPTIBLE_WORDS = {"true": "true", "yes": "true", "on": "true", "false": "false", "no": "false", "off": "false",
                       "auto": "auto"}
#: what the field allows, in words (the recipe's field hints and every refusal)
INTERRUPTIBLE_ALLOWED = ("true, false or auto (auto: only when the expected cost with restarts is lower); yes and on "
                         "read as true, no and off as false")


#: what every "interruptible without checkpoint_dir" warning says (to find it again when a flag changes the value)
_NO_CHECKPOINT_MARK = "without 'checkpoint_dir:': after a preemption the job restarts from the beginning"


def interruptible_warning(said: str, value: str, checkpoint_dir: str | None, path: Path | None = None) -> str | None:
    """The warning for interruptible capacity without a ``checkpoint_dir`` (None when it does not apply): ``said``
    is where the value came from (``r.yaml:4: interruptible: true`` or ``--interruptible true``), ``path`` the
    recipe file to set ``checkpoint_dir:`` in when a flag set the value."""
    if value == "false" or checkpoint_dir is not None:
        return None
    return (f"{said} {_NO_CHECKPOINT_MARK}; set checkpoint_dir: " + (f"in {path} " if path else "")
            + "to the folder your script saves to and loads from")


def interruptible_word(value: Any) -> str | None:
    """``value`` (a YAML boolean or text) as ``"true"``, ``"false"`` or ``"auto"`` by :data:`INTERRUPTIBLE_WORDS`
    (case and surrounding blanks ignored); None when it is none of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return INTERRUPTIBLE_WORDS.get(value.strip().lower())
    return None


def interruptible_refusal(said: str, value: Any, setting: str) -> tuple[str, str]:
    """The message and the fix for an ``interruptible`` value that is not one of :data:`INTERRUPTIBLE_WORDS`, one
    style for the recipe field and the flag: ``said`` names where it came from (``r.yaml:4: field 'interruptible':``
    or ``--interruptible``), ``setting`` how the fix is written (``interruptible:`` or ``--interruptible``)."""
    from broker.core.choices import closest

    near = closest(str(value), INTERRUPTIBLE_WORDS) if isinstance(value, str) else None
    near = INTERRUPTIBLE_WORDS[near] if near else None
    mean = f"did you mean {setting} {near}? " if near else ""
    return (f"{said} {value!r} is not one of the allowed values: {INTERRUPTIBLE_ALLOWED}",
            f"{mean}e.g. {setting} auto (interruptible capacity only when its expected cost is lower), or "
            f"{setting} false (on-demand)")


def check_interruptible(flag: str, value: str | None) -> str | None:
    """A command line's ``--interruptible`` value in the recipe field's words (:func:`interruptible_word`:
    ``Auto`` -> ``auto``, ``yes`` -> ``true``), None when not given.  Raises BadInput naming the flag, the allowed
    words and the fix, as the recipe field's error does."""
    if value is None:
        return None
    v = interruptible_word(value)
    if v is None:
        message, hint = interruptible_refusal(flag, value, flag)
        raise BadInput(message, hint=hint)
    return v
