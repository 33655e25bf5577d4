"""Console helpers (rich): one stdout console, one stderr console, JSON output."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from rich.console import Console

console = Console(highlight=False, soft_wrap=True, emoji=False)  # names like "a:rocket:b" print as written
err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


def print_json(data: Any) -> None:
    """Print ``data`` as JSON on stdout (datetimes as ISO 8601, pydantic models dumped)."""

    def default(o: Any) -> Any:
        if hasattr(o, "model_dump"):
            return o.model_dump(mode="json")
        if isinstance(o, datetime):
            return o.isoformat()
        return str(o)

    print(json.dumps(data, default=default, indent=2))


def usd(x: float | None) -> str:
    """'$1.23' (or '-' for None); amounts under a cent keep 4 decimals."""
    if x is None:
        return "-"
    return f"${x:,.4f}" if 0 < abs(x) < 0.01 else f"${x:,.2f}"


def hours(h: float | None) -> str:
    if h is None:
        return "-"
    if h == float("inf"):
        return "unlimited"
    return f"{h:.2f} h" if h < 100 else f"{h:,.0f} h"


def echo_line(line: str) -> None:
    """Print a streamed log line verbatim (no markup interpretation)."""
    console.out(line, highlight=False)
