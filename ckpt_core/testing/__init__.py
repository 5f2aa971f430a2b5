"""Conformance kit for ``CheckpointEngine`` transports (see docs/writing-a-transport.md).

A transport's test suite inherits :class:`TransportConformance` and names its backend::

    from ckpt_core.testing import TransportConformance

    class TestMyTransport(TransportConformance):
        backend = "my_transport"

The kit's fixtures are defined on that class (all named ``conformance_*``); the pytest plugin
:mod:`ckpt_core.testing.plugin` (loaded automatically when ckpt-core is installed) only
registers the ``ckpt_conformance`` marker. :mod:`ckpt_core.testing.in_process` is an in-process
transport: the smallest complete one, and a way to test code that drives an engine. The names
below are imported on first use, so that worker processes importing
:mod:`ckpt_core.testing.weights` do not import pytest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckpt_core.testing.cluster import ConformanceCluster, Shape
    from ckpt_core.testing.conformance import TransportConformance

__all__ = ["ConformanceCluster", "Shape", "TransportConformance"]

_EXPORTS = {
    "ConformanceCluster": ".cluster",
    "Shape": ".cluster",
    "TransportConformance": ".conformance",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
