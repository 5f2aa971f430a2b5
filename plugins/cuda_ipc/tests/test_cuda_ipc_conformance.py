"""The ckpt-core conformance kit, run on the cuda_ipc backend.

The shared-memory mode (``device="cpu"``) runs everywhere; the CUDA mode runs under the
``gpu`` marker and is skipped without a CUDA device. cuda_ipc moves buckets through buffers
on one node and broadcasts from policy rank 0 (it has no ``topology`` option), so the shapes
carry no topology.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_core.testing import Shape, TransportConformance

# One-to-many; and a second policy rank that has no receiver and must drain its weights.
SHAPES = (Shape(1, 2), Shape(2, 1))


class TestCudaIpcCpuConformance(TransportConformance):
    backend = "cuda_ipc"
    shapes = SHAPES

    @pytest.fixture(scope="class")
    @classmethod
    def engine_options(cls) -> dict[str, Any]:
        return {"device": "cpu"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_ipc device='cuda' needs a CUDA device")
class TestCudaIpcCudaConformance(TransportConformance):
    backend = "cuda_ipc"
    shapes = SHAPES
    # Every worker maps buffers on the current device (colocated on one GPU, as cuda_ipc is
    # meant to run); checksums stay off, as they are verified in host memory only.
    engine_options = {"device": "cuda"}
