"""The per-tensor floor the performance issue sets, measured in the run it is compared in.

What no refit of N tensors can avoid: the sender taking one ``uint8`` view of each tensor, and
the receiver cutting one buffer into N tensors of the same shapes with their ``(name,
tensor)`` pairs. Both in this process, on tensors and a buffer made before the clock starts.
"""

from __future__ import annotations

import time

import torch


def view_floor_seconds(count: int, nbytes: int, reps: int) -> float:
    """The fastest of ``reps`` runs of (sender's views + receiver's cut) for ``count`` float32
    tensors of ``nbytes`` each. The fastest, not the median: a floor is what the work costs
    when nothing else intervenes (here, Python's cyclic collector, which a run of 40,000 new
    objects sometimes sets off, at 5x the cost)."""
    elements = nbytes // 4
    tensors = [torch.empty(elements) for _ in range(count)]
    names = [f"model.layers.{i // 10}.weight_{i % 10}" for i in range(count)]
    buffer = torch.empty(count * nbytes, dtype=torch.uint8)
    samples = []
    for _ in range(max(1, reps)):
        start = time.perf_counter()
        views = [t.view(torch.uint8) for t in tensors]
        # The cheapest cut: one split of the buffer, viewed as the tensors' dtype.
        pairs = list(zip(names, buffer.view(torch.float32).split(elements)))
        samples.append(time.perf_counter() - start)
        assert len(views) == len(pairs) == count
        del views, pairs
    return min(samples)
