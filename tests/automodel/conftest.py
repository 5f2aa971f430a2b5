"""Fixtures for the ckpt_core.automodel tests: a 1-rank Gloo default group and its mesh.

nemo_automodel's first import takes ~10 s, so test modules build expensive state once
(module scope). The default process group is created per module and destroyed at its
end, so no other test folder ever sees it.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A (dp=1, tp=1) CPU mesh on a 1-rank Gloo default group, torn down after the module."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process; these tests need their own")
    # The store binds a port of its own choosing: a port probed free and bound later can be
    # taken in between by another test process.
    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()
