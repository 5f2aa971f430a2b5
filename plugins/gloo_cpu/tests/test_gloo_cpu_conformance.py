"""The ckpt-core conformance kit, run on the gloo_cpu backend (both topologies)."""

from __future__ import annotations

from ckpt_core.testing import Shape, TransportConformance


class TestGlooCpuConformance(TransportConformance):
    backend = "gloo_cpu"
    # One-to-many broadcast; and a pair whose second policy rank has no receiver and drains.
    shapes = (Shape(1, 2, "broadcast"), Shape(2, 1, "paired"))
