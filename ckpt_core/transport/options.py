"""Checks for engine options: each returns the value, or raises ``EngineOptionError`` naming
the engine, the option, the value and what is accepted."""

from __future__ import annotations

import math
from typing import Any

from ckpt_core.errors import EngineOptionError

__all__ = ["check_bool", "check_choice", "check_positive_number"]


def check_positive_number(owner: str, option: str, value: Any) -> float:
    """``value`` as a finite float > 0, else ``EngineOptionError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise EngineOptionError(f"{owner}: {option} must be a finite number > 0, got {value!r}")
    return float(value)


def check_choice(owner: str, option: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise EngineOptionError(f"{owner}: {option} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_bool(owner: str, option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EngineOptionError(f"{owner}: {option} must be True or False, got {value!r}")
    return value
