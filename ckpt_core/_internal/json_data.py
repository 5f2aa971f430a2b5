"""Is a value plain JSON data? Checked on every peer's ``prepare()`` metadata at init.

Metadata crosses processes as JSON, so a value that is not JSON data (bytes, a tensor, a set)
or is nested deeper than any real metadata (a forged layout ~1000 levels deep, which
``json.loads`` accepts) must be refused at the door with a message naming where it is, not
surface later as a ``TypeError`` or a ``RecursionError`` from whichever check touches it first.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 32
"""Deepest nesting of containers metadata may have (real metadata nests 6 levels at most)."""


def json_data_problem(value: Any) -> str | None:
    """Why ``value`` is not plain JSON data (mappings with string keys, lists, strings, ints,
    finite floats, booleans, ``None``), as ``"<path> is ..."``; ``None`` if it is."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if item is None or isinstance(item, (str, bool, int)):
            continue
        where = (path if len(path) <= 120 else f"{path[:120]}...") or "the value"
        if isinstance(item, float):
            if not math.isfinite(item):
                return f"{where} is {item!r}, which JSON cannot carry"
            continue
        if not isinstance(item, (dict, list)):
            return f"{where} is a {type(item).__name__}, not JSON data"
        if depth == MAX_DEPTH:
            return f"{where} is nested deeper than {MAX_DEPTH} levels"
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"{where} has a key that is a {type(key).__name__}, not a string: {key!r:.60}"
                stack.append((child, f"{path}[{key[:60]!r}]", depth + 1))
        else:
            stack.extend((child, f"{path}[{index}]", depth + 1) for index, child in enumerate(item))
    return None
