"""A host stand-in for the CUDA platform, so the CPU suite runs the nccl engine's own code.

``HostNcclEngine`` is ``NcclCheckpointEngine`` with only the hardware swapped: buffers on the
host, a Gloo group where NCCL would be, a pack "stream" that copies in place. Everything
else (option checks, metadata, GPU-distinctness check, payload group, sender and receiver
wrappers, device checksum) is the production code, run through real processes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch

from ckpt_core.transport import gloo_group
from ckpt_nccl.cuda import PackStream, Platform
from ckpt_nccl.engine import NcclCheckpointEngine


class HostPackStream:
    def follow_caller(self) -> None:
        pass

    def active(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def pack(self, target: torch.Tensor, chunk: torch.Tensor) -> None:
        target.copy_(chunk)


class HostPlatform:
    """Host memory and Gloo; each process counts as one distinct "GPU"."""

    def unavailable_reason(self) -> str | None:
        return None

    def resolve_device(self, owner: str, index: int | None) -> torch.device:
        return torch.device("cpu")

    def device_identity(self, device: torch.device) -> str:
        return f"host-{os.uname().nodename}-pid{os.getpid()}"

    def new_group(self, store: Any, rank: int, size: int, *, device: torch.device, timeout_s: float) -> Any:
        return gloo_group(store, rank, size, host="127.0.0.1", timeout=datetime.timedelta(seconds=timeout_s))

    def new_pack_stream(self, device: torch.device) -> PackStream:
        return HostPackStream()

    def release_cached_memory(self, device: torch.device) -> None:
        pass


class HostNcclEngine(NcclCheckpointEngine):
    platform: ClassVar[Platform] = HostPlatform()
