"""pytest plugin of the ckpt-core conformance kit (entry point ``pytest11: ckpt_core_conformance``).

It is loaded by every pytest run in an environment where ckpt-core is installed, so it adds
nothing to a session but the ``ckpt_conformance`` marker, set on the kit's tests so that
``-m ckpt_conformance`` selects them. The kit's fixtures live on the kit's class
(:class:`~ckpt_core.testing.conformance.TransportConformance`), all named ``conformance_*``.

With ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` set, load it with ``-p ckpt_core.testing.plugin``.
"""

from __future__ import annotations

import pytest

MARKER = "ckpt_conformance"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{MARKER}: a test of the ckpt-core transport conformance kit")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the kit's tests, so ``-m ckpt_conformance`` selects them."""
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and any(
            base.__name__ == "TransportConformance" and base.__module__ == "ckpt_core.testing.conformance"
            for base in cls.__mro__
        ):
            item.add_marker(MARKER)
