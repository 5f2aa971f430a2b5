"""The nccl engine's own code end to end on the host: the ckpt-core conformance kit in real
processes, with Gloo standing in for NCCL and host memory for the GPU (see
nccl_host_platform.py); plus the engine's host-checkable setup."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from nccl_host_platform import HostNcclEngine

from ckpt_core.errors import EngineOptionError
from ckpt_core.orchestration.coordinator import CallResult
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_core.testing import Shape, TransportConformance


class TestNcclOnHostConformance(TransportConformance):
    backend = "nccl_host_platform:HostNcclEngine"
    worker_env = {"PYTHONPATH": str(Path(__file__).resolve().parent)}
    # One-to-many broadcast; and a pair whose second policy rank has no receiver and drains.
    # The device checksum (off by default) is on in both.
    engine_options = {"checksum": True}
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


def test_the_rendezvous_store_is_closed_once_the_payload_group_has_connected():
    """NCCL builds a communicator through the store at a group's first message, so the engine
    moves that first byte during init and closes the store after it, as the Gloo engines do:
    a client that reaches the store's port after init finds nothing, and refits still run."""
    specs, labels = refit_worker_specs(
        backend="nccl_host_platform:HostNcclEngine",
        num_policy=1,
        num_rollout=1,
        bucket_size=1 << 16,
        engine_kwargs={"timeout_s": 30, "topology": "paired"},
        weights="ckpt_core.testing.weights:every_dtype",
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]),
    }
    with LocalProcessPool(specs, labels=labels, env=env) as pool:
        metadata = [r.value for r in _succeeded(pool.call([(0, "prepare", {}), (1, "prepare", {})], 120))]
        sizes = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
        try:
            _succeeded(pool.call([(0, "init", sizes), (1, "init", sizes)], 120))
            host, port = metadata[0]["host"], metadata[0]["port"]
            with pytest.raises((RuntimeError, OSError)):
                dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=1)).set("stranger", "x")
            sent, received = (
                r.value
                for r in _succeeded(
                    pool.call([(0, "refit", {"refit_index": 0}), (1, "refit", {"refit_index": 0})], 120)
                )
            )
            assert received["digests"] == sent["digests"] and len(sent["digests"]) > 10
        finally:
            pool.call([(0, "finalize", {}), (1, "finalize", {})], 60)


def _succeeded(results: list[CallResult]) -> list[CallResult]:
    failed = [r.describe() for r in results if not r.ok]
    assert not failed, failed
    return results
