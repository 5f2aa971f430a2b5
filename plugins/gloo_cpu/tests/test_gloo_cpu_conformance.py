"""The ckpt-core conformance kit, run on the gloo_cpu backend (both topologies, each with a
policy rank that has no receiver and drains; paired with two pairs, so crossed ranks show)."""

from __future__ import annotations

from ckpt_core.testing import Shape, TransportConformance


class TestGlooCpuConformance(TransportConformance):
    backend = "gloo_cpu"
    shapes = (Shape(2, 2, "broadcast"), Shape(3, 2, "paired"))
