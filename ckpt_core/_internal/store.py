"""A store whose connection to the rendezvous can be cut once groups have formed.

Gloo groups keep a reference to the store they were built on for their whole life, so the
``TCPStore`` served by policy rank 0 used to stay open, unauthenticated, as long as the
engine: any client could write keys into it and grow that process's memory without bound.
Groups are built on a :class:`DetachableStore` instead; :meth:`DetachableStore.detach` drops
its ``TCPStore`` once every member's groups have formed, which closes the server (policy
rank 0) or the client connection (everyone else). Groups never use the store after forming
(unless ``TORCH_GLOO_LAZY_INIT`` is set: then the store is never detached, see
:func:`ckpt_core._internal.fence.lazy_init`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


class DetachableStore(dist.Store):
    """Forwards every call to ``inner`` until :meth:`detach`; then each raises ``RuntimeError``."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner

    def detach(self) -> None:
        self._inner = None

    @property
    def attached(self) -> bool:
        return self._inner is not None

    def _store(self) -> Any:
        if self._inner is None:
            raise RuntimeError("the rendezvous store was closed after the groups formed")
        return self._inner

    def set(self, key: str, value: Any) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store().get(key))

    def add(self, key: str, value: int) -> int:
        return int(self._store().add(key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._store().compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self._store().check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._store().wait(keys)
        else:
            self._store().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._store().delete_key(key))

    def num_keys(self) -> int:
        return int(self._store().num_keys())
