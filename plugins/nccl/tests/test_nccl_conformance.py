"""The ckpt-core conformance kit, run on the nccl backend (GPU only).

NCCL cannot put two ranks of one group on the same GPU, so each worker gets its own device
(:meth:`worker_engine_options`): the shapes of the first class need two GPUs, the one-to-two
broadcast of the second three; each is skipped without them. Broadcast groups hold policy
rank 0 and every rollout rank (1 + R GPUs); a pair holds policy rank i and rollout rank i.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_core.testing import Shape, TransportConformance

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


class _OneGpuPerRank(TransportConformance):
    backend = "nccl"

    def worker_engine_options(self, options: dict[str, Any], *, role: str, rank: int, shape: Shape) -> dict[str, Any]:
        if shape.paired:  # pair i: policy i and rollout i, on two different GPUs
            index = 2 * rank + (role == "rollout")
        else:  # one group: policy rank 0 and rollouts 1..R; idle policy ranks join no group
            index = rank + 1 if role == "rollout" else rank
        return {**options, "device": f"cuda:{index % max(GPUS, 1)}"}


# Skip reasons start with "needs N GPUs": scripts/gpu_check.sh reports such a test as not
# verified on a machine with fewer GPUs, and as a failure on one with enough.
@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs: one per rank of an NCCL group; found {GPUS}")
class TestNcclConformance(_OneGpuPerRank):
    # (2, 1, paired): policy rank 1 has no partner and drains its weights.
    shapes = (Shape(1, 1, "broadcast"), Shape(2, 1, "paired"), Shape(2, 2, "paired"))


@pytest.mark.gpu
@pytest.mark.skipif(
    GPUS < 3, reason=f"needs 3 GPUs: policy rank 0 and two rollout ranks in one NCCL group; found {GPUS}"
)
class TestNcclBroadcastToTwoConformance(_OneGpuPerRank):
    shapes = (Shape(1, 2, "broadcast"),)
