"""ckpt-core's conformance kit, run on this package's backend (installed, found by name)."""

from __future__ import annotations

from ckpt_core.testing import Shape, TransportConformance


class TestTcpExampleConformance(TransportConformance):
    backend = "tcp_example"
    # One policy rank broadcasting to two rollouts; and a second policy rank with no receiver.
    shapes = (Shape(1, 2), Shape(2, 1))
