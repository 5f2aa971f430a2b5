"""Checks for engine options (and for the options of what drives engines, such as the vLLM
adapter): each returns the value, or raises ``EngineOptionError`` naming the owner, the option,
the value and what is accepted. Transport authors import them from ``ckpt_core.transport``."""

from __future__ import annotations

import math
from typing import Any

from ckpt_core.errors import EngineOptionError

__all__ = ["MAX_TIMEOUT_S", "check_bool", "check_choice", "check_positive_number"]


MAX_TIMEOUT_S = 30 * 86400.0
"""Longest ``timeout_s`` (30 days). Gloo and the store keep deadlines in nanoseconds of an
int64, which overflows past about 9.2e9 s (and ``timedelta`` past 8.6e13 s)."""


def check_positive_number(owner: str, option: str, value: Any, maximum: float = math.inf) -> float:
    """``value`` as a finite float in (0, ``maximum``], else ``EngineOptionError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise EngineOptionError(f"{owner}: {option} must be a finite number > 0, got {value!r}")
    if value > maximum:
        raise EngineOptionError(f"{owner}: {option} must be at most {maximum:g}, got {value!r}")
    return float(value)


def check_choice(owner: str, option: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise EngineOptionError(f"{owner}: {option} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_bool(owner: str, option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EngineOptionError(f"{owner}: {option} must be True or False, got {value!r}")
    return value
