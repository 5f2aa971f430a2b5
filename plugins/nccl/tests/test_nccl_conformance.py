"""The ckpt-core conformance kit, run on the nccl backend (GPU only).

NCCL cannot put two ranks of one group on the same GPU, so each worker gets its own device
(:meth:`worker_engine_options`) and the class needs at least two GPUs; without them it is
skipped. Broadcast groups hold policy rank 0 and every rollout rank (1 + R GPUs); a pair
holds policy rank i and rollout rank i.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_core.testing import Shape, TransportConformance

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _shapes(gpus: int) -> tuple[Shape, ...]:
    # (2, 1, paired): policy rank 1 has no partner and drains its weights.
    shapes = [Shape(1, 1, "broadcast"), Shape(2, 1, "paired"), Shape(2, 2, "paired")]
    if gpus >= 3:
        shapes.append(Shape(1, 2, "broadcast"))
    return tuple(shapes)


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"nccl needs one GPU per rank of a group: >= 2 CUDA devices, found {GPUS}")
class TestNcclConformance(TransportConformance):
    backend = "nccl"
    shapes = _shapes(GPUS)

    def worker_engine_options(self, options: dict[str, Any], *, role: str, rank: int, shape: Shape) -> dict[str, Any]:
        if shape.paired:  # pair i: policy i and rollout i, on two different GPUs
            index = 2 * rank + (role == "rollout")
        else:  # one group: policy rank 0 and rollouts 1..R; idle policy ranks join no group
            index = rank + 1 if role == "rollout" else rank
        return {**options, "device": f"cuda:{index % max(GPUS, 1)}"}
