"""The ckpt-core conformance kit, run on cuda_ipc's shared-memory mode."""

from __future__ import annotations

from ckpt_core.testing import Shape, TransportConformance


class TestCudaIpcConformance(TransportConformance):
    backend = "cuda_ipc"
    engine_options = {"device": "cpu"}
    # One policy process feeding two rollouts; and two policy ranks, the second draining.
    shapes = (Shape(1, 2), Shape(2, 1))
