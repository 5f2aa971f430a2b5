"""Where a benchmark's results go: ``<name>.json`` (the figures) and ``<name>.md`` (the table)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_results(out: Path, name: str, results: dict[str, Any], table: str) -> None:
    """``results`` to ``<out>/<name>.json`` and ``table`` to ``<out>/<name>.md`` (``out`` made
    if missing)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{name}.md").write_text(table)
