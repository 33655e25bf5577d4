"""``broker lint`` on broker recipes (``*.yaml``/``*.yml``): the recipe's fields are validated as ``broker run``
validates them, and the script it names is linted as ``broker run`` lints it (started by torchrun, so SLURM_*
rank variables are findings; :func:`broker.lint.rules.lint_recipe_file`).  A YAML file is a recipe when it is a
mapping with a ``script:`` field."""

from __future__ import annotations

import re
from pathlib import Path

RECIPE_SUFFIXES = (".yaml", ".yml")
#: what to give broker lint instead of a YAML file that is not a recipe
RECIPE_ADVICE = ("pass a broker recipe (a YAML mapping with a 'script:' field), a Python training script "
                 "or a Slurm batch script")


def is_yaml_path(p: Path) -> bool:
    return p.suffix.lower() in RECIPE_SUFFIXES


def not_a_recipe(p: Path) -> str | None:
    """None when the YAML file at ``p`` is a broker recipe, otherwise what it is instead (one phrase, e.g.
    "not valid YAML (line 3: ...)", "a YAML list, not a mapping of recipe fields").  Raises OSError when it
    cannot be read."""
    from broker.core.errors import BadInput
    from broker.core.recipe_yaml import _read_text, parse_yaml

    try:
        _, data = parse_yaml(_read_text(p), str(p))
    except BadInput as e:  # not YAML, too large, control characters: the reader's own sentence says which
        return re.sub(rf"^{re.escape(str(p))}:?\s*", "", e.message)
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a YAML {type(data).__name__}"
        return f"{kind}, not a mapping of recipe fields (name, script, nodes, ...)"
    if "script" not in data:
        return "a YAML mapping without a 'script:' field"
    return None
