"""Imported at start-up by the Python processes of the vLLM engines and servers these tests
start (``conftest.vllm_process_env`` puts this directory first on their ``PYTHONPATH``).

vLLM's workers busy-wait after each message from their engine (``SpinCondition``, reader side:
``busy_loop_s``, one second), trading a core for latency on machines that have one to spare.
CI has two cores shared by three test processes and every engine they start, so that spin took
the cores the tests needed: one TP 2 test class used 154 CPU-seconds with it and 134 without
(alone on a 2-core machine; an idle TP 2 engine burned 2 CPU-seconds in the 3 s after a
call). Here the spin lasts 10 ms; after it a worker waits on vLLM's own notification socket,
as it does after any idle second, so the messages and what the tests check are unchanged. A
vLLM whose ``SpinCondition`` is shaped otherwise is left as it is (the tests only run slower)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
BUSY_LOOP_S = 0.01


def _shorten_spin(module: ModuleType) -> None:
    condition = getattr(module, "SpinCondition", None)
    init = getattr(condition, "__init__", None)
    if init is None or init.__defaults__ is None:
        return
    names = [p.name for p in inspect.signature(init).parameters.values() if p.default is not inspect.Parameter.empty]
    if "busy_loop_s" in names:
        defaults = list(init.__defaults__)
        defaults[names.index("busy_loop_s")] = BUSY_LOOP_S
        init.__defaults__ = tuple(defaults)


class _ShortSpin(importlib.abc.MetaPathFinder):
    """Finds vLLM's shm_broadcast module as the path finder does, and patches it once loaded."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        load = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            _shorten_spin(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _ShortSpin())
