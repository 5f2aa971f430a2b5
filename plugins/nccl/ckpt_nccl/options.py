"""Validation of the ``nccl`` engine's options, runnable without CUDA.

Everything that can be checked from the values alone is checked here, before the engine
asks whether CUDA and NCCL are present, so a bad config is reported as such on any machine.
Whether ``cuda:N`` exists on this machine is checked later, by the platform.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ckpt_core.errors import EngineOptionError
from ckpt_core.transport import MAX_TIMEOUT_S, check_bool, check_choice, check_positive_number

NCCL_TOPOLOGIES = ("broadcast", "paired")
"""DistributedEngine's topologies but ``"fanout"`` (a communicator per destination: not yet
tested on GPUs)."""

_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")


@dataclasses.dataclass(frozen=True)
class NcclOptions:
    """The engine's options after validation."""

    bucket_size: int
    topology: str
    host: str
    timeout_s: float
    checksum: bool
    device_index: int | None
    """``None`` means the current CUDA device at construction time."""
    release_after_refit: bool
    shard_expert_weights: bool


def parse_device(owner: str, device: Any) -> int | None:
    """The CUDA device index named by ``device`` (``"cuda"`` -> ``None``, ``"cuda:1"`` -> 1).

    Accepts ``"cuda"``, ``"cuda:N"`` and ``torch.device`` objects of type ``cuda``; anything
    else raises ``EngineOptionError``.
    """
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise EngineOptionError(
                f"{owner}: device must be a CUDA device ('cuda' or 'cuda:N'), got {device!r}: "
                "the nccl backend keeps its bucket buffers on a GPU"
            )
        return device.index
    if isinstance(device, str):
        match = _CUDA_DEVICE.fullmatch(device.strip())
        if match:
            return None if match.group(1) is None else int(match.group(1))
    raise EngineOptionError(
        f"{owner}: device must be 'cuda' (the current CUDA device) or 'cuda:N' with N >= 0, got {device!r}"
    )


def check_options(
    owner: str,
    *,
    bucket_size: Any,
    topology: Any,
    host: Any,
    timeout_s: Any,
    checksum: Any,
    device: Any,
    release_after_refit: Any,
    shard_expert_weights: Any,
    auth_token: Any = None,
) -> NcclOptions:
    """Validate every option; raises ``EngineOptionError`` naming the first bad one.

    ``auth_token`` is only checked here (the core keeps it; see :mod:`ckpt_core._internal.auth`)."""
    if auth_token is not None and (not isinstance(auth_token, str) or not auth_token):
        raise EngineOptionError(f"{owner}: auth_token must be a non-empty string or None")
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise EngineOptionError(f"{owner}: bucket_size must be an int >= 1 (bytes), got {bucket_size!r}")
    if not isinstance(host, str) or not host:
        raise EngineOptionError(f"{owner}: host must be a non-empty address string, got {host!r}")
    return NcclOptions(
        bucket_size=bucket_size,
        topology=check_choice(owner, "topology", topology, NCCL_TOPOLOGIES),
        host=host,
        timeout_s=check_positive_number(owner, "timeout_s", timeout_s, MAX_TIMEOUT_S),
        checksum=check_bool(owner, "checksum", checksum),
        device_index=parse_device(owner, device),
        release_after_refit=check_bool(owner, "release_after_refit", release_after_refit),
        shard_expert_weights=check_bool(owner, "shard_expert_weights", shard_expert_weights),
    )
