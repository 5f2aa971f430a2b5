"""ckpt-core's conformance kit, run on this backend.

Install the package first (``pip install -e .[test]``): the kit finds the backend by its
entry-point name, in this process and in the worker processes it starts.
"""

from __future__ import annotations

from ckpt_core.testing import Shape, TransportConformance


class TestMyTransportConformance(TransportConformance):
    backend = "my_transport"
    # engine_options = {"my_option": 1}       # engine_kwargs every worker gets
    # Process counts the refit tests run on. Keep one with a policy rank that has no receiver.
    shapes = (Shape(1, 2), Shape(2, 1))
