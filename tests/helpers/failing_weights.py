"""A weights factory that fails midway: for tests of refits that break after some weights."""

from __future__ import annotations

from typing import Any

from ckpt_core.testing.weights import Weights, drifting


def drifting_then_failing(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """:func:`~ckpt_core.testing.weights.drifting`'s weights, raising ``RuntimeError`` after
    ``params["fail_after"]`` of them (the sender's process lives on)."""
    for count, entry in enumerate(drifting(params, refit_index=refit_index, rank=rank)):
        if count == params["fail_after"]:
            raise RuntimeError(f"the trainer's weights failed after {count}")
        yield entry
