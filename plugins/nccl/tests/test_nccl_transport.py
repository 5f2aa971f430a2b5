"""The nccl transport's pieces in one process: the payload group's send/recv mapping, and
which workers share a link."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from ckpt_core.errors import EngineOptionError, WireFormatError
from ckpt_core.transport import gloo_group
from ckpt_nccl.transport import PayloadGroup, check_distinct_gpus, link_members


def _solo_group() -> PayloadGroup:
    return PayloadGroup(gloo_group(dist.HashStore(), 0, 1, host="127.0.0.1", timeout=datetime.timedelta(seconds=10)))


def test_payload_group_broadcasts_and_refuses_send_recv_outside_a_pair():
    group = _solo_group()
    tensor = torch.arange(5)
    group.broadcast(tensor, 0).wait(datetime.timedelta(seconds=10))
    assert torch.equal(tensor, torch.arange(5))
    with pytest.raises(ValueError, match="needs a pair"):
        group.send([tensor], 1, 3)
    with pytest.raises(ValueError, match="needs a pair"):
        group.recv([tensor], 0, 3)
    group.shutdown()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("topology", "role", "rank", "members"),
    [
        ("broadcast", "policy", 0, [0, 3, 4]),
        ("broadcast", "policy", 2, []),
        ("broadcast", "rollout", 1, [0, 3, 4]),
        ("paired", "policy", 1, [1, 4]),
        ("paired", "policy", 2, []),
        ("paired", "rollout", 0, [0, 3]),
    ],
)
def test_link_members(topology, role, rank, members):
    assert link_members(topology, role, rank, train_world_size=3, rollout_world_size=2) == members


def test_distinct_gpus_pass_and_a_shared_gpu_names_both_workers():
    metadata = [
        {"gpu_uuid": "GPU-a", "device": "cuda:0"},
        {"gpu_uuid": "GPU-b"},
        {"gpu_uuid": "GPU-a", "device": "cuda:0"},
    ]
    check_distinct_gpus("E", metadata, [0, 1], train_world_size=2)
    with pytest.raises(EngineOptionError, match=r"policy rank 0 and rollout rank 0 are on the same GPU \(GPU-a"):
        check_distinct_gpus("E", metadata, [0, 1, 2], train_world_size=2)
    with pytest.raises(WireFormatError, match=r"metadata\[1\] has no 'gpu_uuid'"):
        check_distinct_gpus("E", [{"gpu_uuid": "x"}, {}], [0, 1], train_world_size=1)
