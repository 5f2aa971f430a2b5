"""Options, availability and registry reporting of the nccl backend, on any machine."""

from __future__ import annotations

import pytest
import torch
from nccl_host_platform import HostNcclEngine

from ckpt_core import create_checkpoint_engine, list_backends
from ckpt_core._internal.device_checksum import device_payload_checksum
from ckpt_core.errors import BackendUnavailableError, EngineOptionError
from ckpt_core.registry import check_engine_kwargs
from ckpt_nccl import NcclCheckpointEngine
from ckpt_nccl.cuda import CudaPlatform
from ckpt_nccl.engine import parse_device

GOOD = dict(
    bucket_size=1 << 20,
    topology="broadcast",
    host="127.0.0.1",
    timeout_s=30.0,
    checksum=True,
    device="cuda",
    release_after_refit=False,
    shard_expert_weights=False,
)
NO_GPU = CudaPlatform().unavailable_reason() is not None


@pytest.mark.parametrize(
    ("device", "index"),
    [
        ("cuda", None),
        ("cuda:0", 0),
        ("cuda:3", 3),
        (" cuda:1 ", 1),
        (torch.device("cuda", 2), 2),
        (torch.device("cuda"), None),
    ],
)
def test_device_names_parse_to_an_index(device, index):
    assert parse_device("E", device) == index


@pytest.mark.parametrize(
    "device", ["cpu", "cuda:-1", "cuda:x", "cuda:", "gpu", "", "CUDA", 0, None, torch.device("cpu")]
)
def test_bad_device_names_are_refused(device):
    with pytest.raises(EngineOptionError, match="device"):
        parse_device("E", device)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("bucket_size", 0, "bucket_size must be a positive int"),
        ("bucket_size", True, "bucket_size must be a positive int"),
        ("topology", "ring", "topology must be one of 'broadcast', 'paired'"),
        ("host", "", "host must be a non-empty address string"),
        ("host", None, "host must be a non-empty address string"),
        ("timeout_s", 0, "timeout_s must be a finite number > 0"),
        ("timeout_s", float("inf"), "timeout_s must be a finite number > 0"),
        ("checksum", "yes", "checksum must be True or False"),
        ("release_after_refit", 1, "release_after_refit must be True or False"),
        ("shard_expert_weights", "yes", "shard_expert_weights must be True or False"),
        ("device", "cpu", "device must be 'cuda'"),
        ("auth_token", "", "auth_token must be a non-empty string or None"),
        ("auth_token", 5, "auth_token must be a non-empty string or None"),
    ],
)
def test_each_bad_option_is_named(option, value, message):
    # The engine's schema checks every value before CUDA is looked for, so on any machine.
    with pytest.raises(EngineOptionError, match=message):
        NcclCheckpointEngine(**{**GOOD, option: value})


def test_good_options_are_kept():
    values = NcclCheckpointEngine.options.parse("E", {**GOOD, "device": "cuda:1", "topology": "paired", "timeout_s": 5})
    assert (values.device, values.topology, values.timeout_s) == (1, "paired", 5.0)


def test_checksum_is_off_by_default_like_every_engine():
    assert NcclCheckpointEngine.options["checksum"].default is False
    assert HostNcclEngine(bucket_size=4096).checksum is False


@pytest.mark.skipif(not NO_GPU, reason="checks the error raised where CUDA or NCCL is missing")
def test_construction_without_cuda_names_what_is_missing():
    with pytest.raises(BackendUnavailableError) as excinfo:
        NcclCheckpointEngine(bucket_size=1 << 20)
    message = str(excinfo.value)
    assert "nccl backend cannot run here" in message
    missing = []
    if not torch.cuda.is_available():
        missing.append("torch.cuda.is_available() is False")
    if not torch.distributed.is_nccl_available():
        missing.append("torch.distributed.is_nccl_available() is False")
    assert missing and all(part in message for part in missing)


@pytest.mark.skipif(not NO_GPU, reason="checks the error raised where CUDA or NCCL is missing")
def test_create_checkpoint_engine_raises_the_same_error():
    with pytest.raises(BackendUnavailableError, match="nccl backend cannot run here"):
        create_checkpoint_engine("nccl", bucket_size_bytes=1 << 20, engine_kwargs={"device": "cuda:0"})


def test_bad_options_are_reported_before_availability():
    with pytest.raises(EngineOptionError, match="device must be"):
        create_checkpoint_engine("nccl", bucket_size_bytes=1 << 20, engine_kwargs={"device": "cpu"})
    with pytest.raises(EngineOptionError, match="topology"):
        NcclCheckpointEngine(bucket_size=1024, topology="ring")


def test_option_names_are_checked_against_the_constructor():
    check_engine_kwargs(NcclCheckpointEngine, {k: v for k, v in GOOD.items() if k != "bucket_size"})
    with pytest.raises(EngineOptionError, match="did you mean 'release_after_refit'"):
        check_engine_kwargs(NcclCheckpointEngine, {"release_after_refits": True})


def test_list_backends_reports_why_it_cannot_run_here():
    (info,) = [b for b in list_backends(details=True) if b.name == "nccl"]
    assert info.loads and info.distribution == "ckpt-nccl"
    assert info.capabilities is not None and info.capabilities.devices == ("cuda",)
    assert set(info.capabilities.topologies) == {"broadcast", "paired"}
    assert info.unavailable_reason == CudaPlatform().unavailable_reason()
    if NO_GPU:
        assert "is False" in info.unavailable_reason


def test_the_engine_attributes_reflect_the_options():
    engine = HostNcclEngine(bucket_size=4096, checksum=True, release_after_refit=True, topology="paired")
    assert engine.checksum and engine.release_after_refit and engine.topology == "paired"
    # Both sides checksum on the device; the core's host-memory xxh3 is never used.
    assert engine._payload_checksum() is device_payload_checksum
    assert HostNcclEngine(bucket_size=4096, checksum=False)._payload_checksum() is None
