"""``KitSettings``: what a conformance class says about the backend under test, checked once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

DEFAULT_BUCKET_SIZE = 64 << 10
"""Bytes per bucket unless a class sets ``bucket_size``: small, so refits span buckets."""


@dataclasses.dataclass(frozen=True)
class KitSettings:
    """``backend`` (an entry-point name in ``ckpt_core.backends``, or ``"module:ClassName"``),
    ``engine_options`` (``engine_kwargs`` of every worker), ``bucket_size`` (bytes) and
    ``worker_env`` (extra environment of worker processes; ``PYTHONPATH`` entries are prepended
    to the inherited one)."""

    backend: str
    engine_options: Mapping[str, Any]
    bucket_size: int
    worker_env: Mapping[str, str]

    @classmethod
    def of(cls, owner: type) -> KitSettings:
        """Read and check the class attributes of a ``TransportConformance`` subclass; a bad
        one is a ``pytest.UsageError`` saying what to set."""
        backend = getattr(owner, "backend", None)
        if not isinstance(backend, str) or not backend:
            raise pytest.UsageError(
                f"{owner.__name__}: the ckpt-core conformance kit needs a backend: set "
                f'`backend = "<entry-point name>"` on the class; got {backend!r}'
            )
        options = getattr(owner, "engine_options", None) or {}
        if not isinstance(options, dict):
            raise pytest.UsageError(
                f"{owner.__name__}.engine_options must be a dict of option name to value, got {options!r}"
            )
        bucket_size = getattr(owner, "bucket_size", DEFAULT_BUCKET_SIZE)
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 64:
            raise pytest.UsageError(f"{owner.__name__}.bucket_size must be an int >= 64 (bytes), got {bucket_size!r}")
        env = getattr(owner, "worker_env", None) or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise pytest.UsageError(f"{owner.__name__}.worker_env must be a dict of str to str, got {env!r}")
        return cls(backend, dict(options), bucket_size, dict(env))
