"""Everything the ``nccl`` engine asks of CUDA and NCCL, behind one small interface.

The engine talks to the hardware only through a :class:`Platform`: whether it can run here,
which device an option names, the GPU's identity, a payload group, a stream to pack on and
how to hand cached memory back. :class:`CudaPlatform` is the real one; a host platform with
the same shape lets the CPU test suite run the rest of the engine through real processes.

The payload group is a ``torch.distributed.ProcessGroupNCCL`` built directly on the
dedicated, prefixed store the core hands over: the default process group is never touched.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ckpt_core.errors import EngineOptionError

logger = logging.getLogger(__name__)

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"
"""ProcessGroupNCCL's ``CleanUpOnly`` mode: on an error or timeout its watchdog aborts the
communicator but leaves the process alive, so the failure reaches the caller as an exception
from the waiting call. The default mode (3) takes the whole process down."""
_environment_lock = threading.Lock()


def use_clean_up_only_mode() -> None:
    """Put ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (:data:`CLEAN_UP_ONLY`) in this process's
    environment, where each ``ProcessGroupNCCL`` reads its error mode when it is constructed.

    Written at most once per process and never restored: the environment is not safe to
    change while other threads read it (``setenv`` racing ``getenv`` can crash the process),
    and every NCCL group already built, this library's or the trainer's, runs watchdog threads.
    The engine calls this when it is constructed, before it builds any group; once the value
    is there, later calls write nothing. NCCL groups the process builds afterwards, the
    caller's included, run in this mode too; groups built before keep theirs. A different
    value set earlier (``torchrun`` sets 1) is replaced, with a warning naming it.
    """
    with _environment_lock:
        previous = os.environ.get(ERROR_HANDLING_ENV)
        if previous == CLEAN_UP_ONLY:
            return
        os.environ[ERROR_HANDLING_ENV] = CLEAN_UP_ONLY
    if previous is not None:
        logger.warning(
            "ckpt-nccl set %s=%s (it was %r) for this process: a failed NCCL transfer must reach the "
            "caller as an error, not end the process; NCCL groups built from now on use that mode",
            ERROR_HANDLING_ENV,
            CLEAN_UP_ONLY,
            previous,
        )


class PackStream(Protocol):
    """Where a sender's device work (packing, checksums) is queued."""

    def follow_caller(self) -> None:
        """Order this stream after the work already queued on the caller's current stream."""

    def active(self) -> AbstractContextManager[Any]:
        """A context in which this stream is the current one."""

    def pack(self, target: torch.Tensor, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` into ``target`` on this stream, after the caller's pending work."""


class Platform(Protocol):
    """What the engine needs from the machine."""

    def unavailable_reason(self) -> str | None:
        """Why the engine cannot run here, or ``None``. Cheap; touches no device memory."""

    def resolve_device(self, owner: str, index: int | None) -> torch.device:
        """The device for option index ``index`` (``None``: the current one), checked to exist."""

    def device_identity(self, device: torch.device) -> str:
        """A string that differs between any two physical devices (a GPU's UUID)."""

    def new_group(self, store: Any, rank: int, size: int, *, device: torch.device, timeout_s: float) -> Any:
        """A connected payload group of ``size`` members on ``store``; this worker is ``rank``."""

    def new_pack_stream(self, device: torch.device) -> PackStream:
        """A dedicated stream for a sender's device work."""

    def release_cached_memory(self, device: torch.device) -> None:
        """Return memory freed by the engine from the allocator's cache to the device."""


class CudaPackStream:
    """A dedicated CUDA stream that follows the caller's current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def follow_caller(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def active(self) -> AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def pack(self, target: torch.Tensor, chunk: torch.Tensor) -> None:
        if chunk.device != self.device and chunk.device.type == "cuda":
            target.copy_(chunk)  # another GPU's memory: keep the plain, caller-ordered copy
            return
        self.follow_caller()
        with self.active():
            target.copy_(chunk, non_blocking=True)
        if chunk.device.type == "cuda":
            # The caller may free the chunk's memory as soon as we return; the allocator
            # must not hand it out again before this stream has read it.
            chunk.record_stream(self.stream)


class CudaPlatform:
    """The real platform: CUDA devices and a ``ProcessGroupNCCL`` per link."""

    def unavailable_reason(self) -> str | None:
        if not dist.is_available():
            return f"torch {torch.__version__} was built without torch.distributed"
        missing = []
        if not torch.cuda.is_available():
            missing.append("no CUDA device is visible (torch.cuda.is_available() is False)")
        if not dist.is_nccl_available():
            missing.append("this torch build has no NCCL library (torch.distributed.is_nccl_available() is False)")
        if not missing:
            return None
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return "; ".join(missing) + f" [torch {torch.__version__}, {build}]"

    def resolve_device(self, owner: str, index: int | None) -> torch.device:
        count = torch.cuda.device_count()
        if index is None:
            index = torch.cuda.current_device()
        if not 0 <= index < count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise EngineOptionError(
                f"{owner}: device 'cuda:{index}' does not exist on this machine: {count} CUDA "
                f"device(s) are visible (CUDA_VISIBLE_DEVICES={visible!r}); pick an index below {count}"
            )
        return torch.device("cuda", index)

    def device_identity(self, device: torch.device) -> str:
        return str(torch.cuda.get_device_properties(device).uuid)

    def new_group(self, store: Any, rank: int, size: int, *, device: torch.device, timeout_s: float) -> Any:
        """A ``ProcessGroupNCCL`` in ``CleanUpOnly`` error mode (see :func:`use_clean_up_only_mode`),
        its communicator created. It keeps ``store`` for life, and its heartbeat monitor asks
        it every second whether a debug dump was requested: ``store`` is a prefix of the core's
        rendezvous ``DetachableStore``, which answers that "no" once the rendezvous closed after
        init, rather than failing (NCCL would log each failure)."""
        use_clean_up_only_mode()  # a no-op after the engine's own call: the value is there
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = datetime.timedelta(seconds=timeout_s)
        group = dist.ProcessGroupNCCL(store, rank, size, options)
        try:
            # Create the communicator now, while every member is inside init: a failure shows
            # up there, not in the middle of the first refit.
            with torch.cuda.device(device):
                group.eager_connect_single_device(device)
        except BaseException:
            group.abort()
            raise
        return group

    def new_pack_stream(self, device: torch.device) -> PackStream:
        return CudaPackStream(device)

    def release_cached_memory(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
