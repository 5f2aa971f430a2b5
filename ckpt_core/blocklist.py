"""``CKPT_CORE_BLOCK_PLUGINS``: entry-point names (backends and hook plugins) never loaded."""

from __future__ import annotations

import os

BLOCK_ENV = "CKPT_CORE_BLOCK_PLUGINS"


def blocked_plugins() -> frozenset[str]:
    """The names in ``CKPT_CORE_BLOCK_PLUGINS`` (comma-separated; spaces around names ignored)."""
    return frozenset(name.strip() for name in os.environ.get(BLOCK_ENV, "").split(",") if name.strip())
