"""The nccl engine's own code end to end on the host: the ckpt-core conformance kit in real
processes, with Gloo standing in for NCCL and host memory for the GPU (see
nccl_host_platform.py); plus the engine's host-checkable setup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nccl_host_platform import HostNcclEngine

from ckpt_core.errors import EngineOptionError
from ckpt_core.testing import Shape, TransportConformance


class TestNcclOnHostConformance(TransportConformance):
    backend = "nccl_host_platform:HostNcclEngine"
    worker_env = {"PYTHONPATH": str(Path(__file__).resolve().parent)}
    # One-to-many broadcast; and a pair whose second policy rank has no receiver and drains.
    # The device checksum is on (the default) in both.
    shapes = (Shape(1, 2, "broadcast"), Shape(2, 1, "paired"))


def test_prepare_returns_json_metadata_naming_the_device():
    engine = HostNcclEngine(bucket_size=1 << 16)
    try:
        metadata = engine.prepare()
        assert json.loads(json.dumps(metadata)) == metadata
        assert metadata["backend"] == "nccl"
        assert metadata["gpu_uuid"].startswith("host-") and metadata["device"] == "cpu"
        assert isinstance(metadata["port"], int) and metadata["host"] == "127.0.0.1"
    finally:
        engine.finalize()


def test_two_link_members_on_one_gpu_are_refused_before_any_rendezvous():
    policy, rollout = HostNcclEngine(bucket_size=4096), HostNcclEngine(bucket_size=4096)
    try:
        metadata = [policy.prepare(), rollout.prepare()]  # one process counts as one "GPU"
        sizes = dict(train_world_size=1, rollout_world_size=1, metadata=metadata)
        with pytest.raises(EngineOptionError, match="policy rank 0 and rollout rank 0 are on the same GPU"):
            policy.init_policy_process_group(worker_rank=0, **sizes)
        with pytest.raises(EngineOptionError, match="cuda_ipc"):
            rollout.init_rollout_process_group(rollout_rank=0, **sizes)
    finally:
        policy.finalize()
        rollout.finalize()
