"""Sizes as people write them: ``"64MiB"`` <-> 67108864."""

from __future__ import annotations

from ckpt_core.cli import parse_size

__all__ = ["format_size", "parse_size", "parse_sizes"]

_STEPS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_size(nbytes: int) -> str:
    """67108864 -> ``"64 MiB"``; sizes that are not a whole number of a unit keep one decimal."""
    for unit, size in _STEPS:
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes} B"


def parse_sizes(text: str) -> list[int]:
    """``"16MiB,64MiB"`` -> ``[16777216, 67108864]``."""
    return [parse_size(part) for part in text.split(",") if part.strip()]
