"""The policy's slot buffers, and the rollouts' mappings of them.

One allocation holds every slot (slot ``k`` starts at ``k * stride``), made once by policy
rank 0 at init and mapped once by each rollout at init; refits only reuse it.

* :class:`HostSlots` (``device="cpu"``): an anonymous ``memfd_create`` file, sized, fully
  allocated, mapped shared by the policy, then sealed against resizing and against any write
  but through that one mapping (``F_SEAL_FUTURE_WRITE``): no other process can write the slots,
  not even one of the same user that reopens the file through ``/proc/<pid>/fd`` (the kernel
  refuses it a writable mapping and ``write()``). Rollouts receive a read-only descriptor over
  the control socket (``SCM_RIGHTS``) and map it read-only. The file has no name anywhere
  (nothing in ``/dev/shm``); the kernel frees it when the last process holding a mapping or
  descriptor exits, however it exits.
* :class:`CudaSlots` (``device="cuda"``): one ``cudaMalloc`` made through cupy, outside any
  memory pool, whose IPC handle is exported once; rollouts on the same physical GPU (checked
  by UUID) open it once (``cudaIpcOpenMemHandle``) and close it at finalize. The slot tensors
  alias that memory (checked at init), and it is freed or unmapped only once no view of it is
  left.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import importlib
import mmap
import os
import sys
import warnings
import weakref
from typing import Any

import torch

from ckpt_core.errors import BackendUnavailableError, EngineOptionError, OutOfMemoryError, WireFormatError

PAGE = 4096
IPC_HANDLE_BYTES = 64
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
"""Linux 5.1+: writes only through mappings that exist when it is set (not exported by Python)."""


def slot_stride(bucket_size: int) -> int:
    """Bytes between slot starts: the bucket size rounded up to a page."""
    return -(-bucket_size // PAGE) * PAGE


class HostSlots:
    """Slot buffers in one anonymous shared-memory file (see the module docstring)."""

    def __init__(self, mapping: Any, fd: int | None, bucket_size: int, num_slots: int, writable: bool) -> None:
        self._fd = fd  # kept by the policy only, to hand read-only copies to rollouts
        self.bucket_size = bucket_size
        self.num_slots = num_slots
        self.stride = slot_stride(bucket_size)
        with warnings.catch_warnings():
            # A read-only mapping is only ever read (the merge copies out of it).
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            whole = torch.frombuffer(mapping, dtype=torch.uint8)
        # The views keep the mapping alive; it is unmapped when the last of them dies.
        self._mapping = weakref.ref(mapping)
        self._range = (whole.data_ptr(), ctypes.sizeof(mapping))
        self._detached = False
        del mapping
        self._views: list[torch.Tensor] = [
            whole[k * self.stride : k * self.stride + bucket_size] for k in range(num_slots)
        ]
        self.writable = writable

    @property
    def mapped(self) -> bool:
        """Whether this process still maps the file (some view of it is alive somewhere)."""
        return self._mapping() is not None and not self._detached

    @classmethod
    def allocate(cls, bucket_size: int, num_slots: int) -> HostSlots:
        """Create, size, allocate and seal the file, then map it (pages faulted in now, once)."""
        size = slot_stride(bucket_size) * num_slots
        fd = os.memfd_create("ckpt-cuda-ipc-slots", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            try:
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
            except (OSError, OverflowError) as exc:  # EFBIG/ENOSPC; a size past off_t
                raise OutOfMemoryError(
                    f"cannot reserve {size} bytes of shared memory for {num_slots} bucket slots "
                    f"({exc}); lower bucket_size_bytes or free memory"
                ) from exc
            # No process holding the file may resize it under a mapping (that would SIGBUS us).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            mapping = _map_shared(fd, size, writable=True)
            try:
                # Only the mapping just made may write from now on; no seal may be added or removed.
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
            except OSError as exc:
                raise BackendUnavailableError(
                    f"cannot seal the shared slot buffers against writes by other processes ({exc}): "
                    "device='cpu' needs Linux 5.1 or newer (F_SEAL_FUTURE_WRITE)"
                ) from exc
        except BaseException:
            os.close(fd)
            raise
        return cls(mapping, fd, bucket_size, num_slots, writable=True)

    def describe(self) -> dict[str, Any]:
        return {"kind": "memfd", "stride": self.stride, "size": self.stride * self.num_slots}

    def open_reader_fd(self) -> int:
        """A new read-only descriptor of the file, for one rollout; the caller closes it."""
        if self._fd is None:
            raise RuntimeError("only the allocating side can hand out descriptors")
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def release_fd(self) -> None:
        """Drop the policy's own descriptor once every rollout has its copy (the mapping stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @classmethod
    def attach(cls, fd: int, description: dict[str, Any], bucket_size: int, num_slots: int) -> HostSlots:
        """Map the policy's file read-only from ``fd`` (which this call closes)."""
        try:
            size = slot_stride(bucket_size) * num_slots
            if description.get("kind") != "memfd" or description.get("size") != size:
                raise WireFormatError(
                    f"policy rank 0 describes its buffers as {description!r}, expected a memfd of "
                    f"{size} bytes for {num_slots} slots of bucket_size={bucket_size}"
                )
            actual = os.fstat(fd).st_size
            if actual != size:
                raise WireFormatError(
                    f"the shared-memory file passed by policy rank 0 has {actual} bytes, expected {size}"
                )
            mapping = _map_shared(fd, size, writable=False)
        finally:
            os.close(fd)
        return cls(mapping, None, bucket_size, num_slots, writable=False)

    def view(self, slot: int) -> torch.Tensor:
        return self._views[slot]

    def publish(self) -> None:
        """Writes to a shared mapping are visible to other processes as soon as they are done."""

    def consumed(self) -> None:
        """Reads by the CPU are done when the copying call returns."""

    def close(self) -> None:
        """Drop the mapping and any descriptor.

        The mapping is unmapped when the last view of it dies, never under a live view (which
        would crash whoever reads it). Views caught in reference cycles, such as the frames
        of a failed refit's traceback, are collected here so the mapping goes now.
        """
        self._views = []
        self.release_fd()
        if self.mapped:
            gc.collect()
        if self.mapped:
            # A view is still referenced from outside any cycle: the frames of an exception
            # being handled (finalize() inside the `except` that caught a failed refit) or a
            # caller's variable. Unmapping under it would crash whoever reads it, so the range
            # gets fresh anonymous memory instead: the file's pages go now, reads stay safe.
            _map_anonymous_over(*self._range)
            self._detached = True


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MAP_FIXED = 0x10  # Linux; the mmap module does not export it
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_shared(fd: int, size: int, *, writable: bool) -> Any:
    """Map ``size`` bytes of ``fd`` shared; returns a ctypes byte array over them, unmapped when
    it is collected. Made through libc rather than the ``mmap`` module, whose objects keep a
    duplicate of the descriptor (and so the file) until they die."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    address = _libc.mmap(None, size, prot, mmap.MAP_SHARED | _POPULATE, fd, 0)
    if address in (None, _MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"mapping {size} bytes of shared memory failed: {os.strerror(errno)}")
    array_type: Any = type("SlotBytes", (ctypes.c_ubyte * size,), {})  # a subclass: weak-referenceable
    mapping = array_type.from_address(address)
    weakref.finalize(mapping, _libc.munmap, address, size)
    return mapping


def _map_anonymous_over(address: int, size: int) -> None:
    """Replace ``[address, address + size)`` with private zero pages (``MAP_FIXED``): what was
    mapped there is unmapped, the range stays valid. The mapping's finalizer unmaps the
    replacement when its last view is collected."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    result = _libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if result != address:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap over the slot buffers failed: {os.strerror(errno)}")


class _DeviceRange:
    """``nbytes`` of device memory at ``pointer``, described for ``torch.as_tensor`` by
    ``__cuda_array_interface__``. torch keeps the object it aliases alive until the last
    tensor viewing that memory is freed, so a finalizer on this object runs only then."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 2,
            "strides": None,
        }


def _release_device_memory(cupy: Any, pointer: int, owner: bool, device_index: int) -> None:
    """Free the allocation (its owner) or close this process's IPC mapping of it, once the
    device has finished the work queued on it (which may still read the memory)."""
    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(device_index):
        runtime.deviceSynchronize()
        if owner:
            runtime.free(pointer)
            return
        try:
            runtime.ipcCloseMemHandle(pointer)
        except Exception:  # noqa: BLE001 - the exporter already freed it (it finalized first, or
            pass  # died); the mapping is gone either way


def _free_when_collected(memory: _DeviceRange, cupy: Any, pointer: int, owner: bool, device: torch.device) -> None:
    finalizer = weakref.finalize(memory, _release_device_memory, cupy, pointer, owner, device.index)
    finalizer.atexit = False  # the process's end releases both, and CUDA may be torn down by then


def import_cupy() -> Any:
    """cupy, whichever wheel provides it (cupy-cuda12x, cupy-cuda13x); ``BackendUnavailableError`` if none."""
    try:
        return importlib.import_module("cupy")
    except Exception as exc:  # ImportError, or a wheel that does not match the driver
        raise BackendUnavailableError(
            f"device='cuda' needs cupy ({type(exc).__name__}: {exc}); install the build for your "
            "CUDA: pip install 'ckpt-cuda-ipc[cuda12]' (cupy-cuda12x) or 'ckpt-cuda-ipc[cuda13]' "
            "(cupy-cuda13x)"
        ) from exc


def gpu_uuid(device: torch.device) -> str:
    """The UUID of the physical GPU behind ``device`` in this process: the same in every
    process that sees that GPU, whatever index ``CUDA_VISIBLE_DEVICES`` gives it there."""
    return str(torch.cuda.get_device_properties(device).uuid)


def check_same_gpu(policy_gpu: Any, rollout_gpu: str, device: torch.device) -> None:
    """Refuse to map policy rank 0's slots from another physical GPU than theirs.

    A pointer opened from a peer GPU's allocation is memory of that GPU: a tensor made on
    ``device`` from it would be a one-time copy, and every later refit would read that copy's
    stale bytes. vLLM's CUDA IPC weight transfer makes the same rule (same GPU, by UUID).
    """
    if not isinstance(policy_gpu, str) or not policy_gpu:
        raise WireFormatError(f"policy rank 0 did not say which GPU its buffers are on (gpu_uuid={policy_gpu!r})")
    if policy_gpu != rollout_gpu:
        raise EngineOptionError(
            f"this rollout's device {device} is GPU {rollout_gpu}, but policy rank 0's buffers are on GPU "
            f"{policy_gpu}: with device='cuda', cuda_ipc maps the policy's memory in place, so every rollout "
            "must use the policy's physical GPU (compare nvidia-smi -L; its index may differ per process under "
            "CUDA_VISIBLE_DEVICES). Put the rollout on that GPU, or use the nccl backend between GPUs"
        )


class CudaSlots:
    """Slot buffers in one device allocation shared by CUDA IPC (see the module docstring).

    ``memory`` is what the views alias: an object that ``torch.as_tensor`` wraps without a copy
    and keeps alive while any view of it is (a :class:`_DeviceRange`; any such object, a host
    array included, serves), whose finalizer frees the memory. ``pointer`` is where that memory
    starts on ``device``; the constructor checks that the slot tensor is that memory, on that
    device (``BackendUnavailableError`` otherwise), so a refit never reads a copy.
    """

    def __init__(self, memory: Any, pointer: int, device: torch.device, bucket_size: int, num_slots: int) -> None:
        self.pointer = pointer
        self.device = device
        self.bucket_size = bucket_size
        self.num_slots = num_slots
        self.stride = slot_stride(bucket_size)
        size = self.stride * num_slots
        references = sys.getrefcount(memory)
        # Memory on another device than `device` (a peer GPU's pointer) is copied here, once,
        # without a word from torch: the check below refuses that.
        whole = torch.as_tensor(memory, device=device)
        if (whole.device, whole.data_ptr(), whole.numel(), whole.dtype) != (device, pointer, size, torch.uint8):
            raise BackendUnavailableError(
                f"the slot buffers would not alias the shared memory: from the {size} bytes at {pointer:#x}, "
                f"torch made {whole.numel()} {whole.dtype} on {whole.device} at {whole.data_ptr():#x} (a copy: "
                f"the memory is not on {device}), and every refit would read that copy's stale bytes. Map the "
                "slots on the GPU that holds them"
            )
        if sys.getrefcount(memory) <= references:
            raise BackendUnavailableError(
                f"torch {torch.__version__} does not keep the memory behind a tensor made by torch.as_tensor "
                "alive, so the slots cannot tell when their last view is gone; this torch is not supported"
            )
        self._memory = weakref.ref(memory)
        self._views: list[torch.Tensor] = [
            whole[k * self.stride : k * self.stride + bucket_size] for k in range(num_slots)
        ]

    @property
    def mapped(self) -> bool:
        """Whether the memory is still allocated (policy) or mapped (rollout): some view of it
        is alive somewhere."""
        return self._memory() is not None

    @classmethod
    def allocate(cls, device: torch.device, bucket_size: int, num_slots: int) -> CudaSlots:
        cupy = import_cupy()
        size = slot_stride(bucket_size) * num_slots
        with cupy.cuda.Device(device.index):
            try:
                pointer = int(cupy.cuda.runtime.malloc(size))
            except (cupy.cuda.runtime.CUDARuntimeError, OverflowError) as exc:
                raise OutOfMemoryError(
                    f"cannot allocate {size} bytes on {device} for {num_slots} bucket slots ({exc}); "
                    "lower bucket_size_bytes or free device memory"
                ) from exc
            try:
                cupy.cuda.runtime.memset(pointer, 0, size)
            except BaseException:
                cupy.cuda.runtime.free(pointer)
                raise
        memory = _DeviceRange(pointer, size)
        # From here on the allocation is freed when the last view of it dies (or the slots fail).
        _free_when_collected(memory, cupy, pointer, True, device)
        return cls(memory, pointer, device, bucket_size, num_slots)

    def describe(self) -> dict[str, Any]:
        """The IPC handle (exported once) and the device's identity, as JSON data."""
        cupy = import_cupy()
        with cupy.cuda.Device(self.device.index):
            handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self.pointer))
            pci_bus_id = cupy.cuda.runtime.deviceGetPCIBusId(self.device.index)
        return {
            "kind": "cuda_ipc",
            "handle": handle.hex(),
            "gpu_uuid": gpu_uuid(self.device),
            "pci_bus_id": pci_bus_id,
            "stride": self.stride,
            "size": self.stride * self.num_slots,
        }

    @classmethod
    def attach(cls, description: dict[str, Any], device: torch.device, bucket_size: int, num_slots: int) -> CudaSlots:
        """Open the policy's IPC handle on ``device``, which must be the policy's physical GPU
        (``EngineOptionError`` naming both GPUs otherwise, before the handle is opened)."""
        size = slot_stride(bucket_size) * num_slots
        handle_hex = description.get("handle")
        if description.get("kind") != "cuda_ipc" or description.get("size") != size or not isinstance(handle_hex, str):
            raise WireFormatError(
                f"policy rank 0 describes its buffers as {description!r:.300}, expected a CUDA IPC "
                f"handle for {size} bytes ({num_slots} slots of bucket_size={bucket_size})"
            )
        try:
            handle = bytes.fromhex(handle_hex)
        except ValueError:
            raise WireFormatError("policy rank 0 sent a CUDA IPC handle that is not hex") from None
        if len(handle) != IPC_HANDLE_BYTES:
            raise WireFormatError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        check_same_gpu(description.get("gpu_uuid"), gpu_uuid(device), device)
        cupy = import_cupy()
        runtime = cupy.cuda.runtime
        with cupy.cuda.Device(device.index):
            try:
                pointer = int(runtime.ipcOpenMemHandle(handle))  # flags default to lazy peer access
            except Exception as exc:
                raise BackendUnavailableError(
                    f"cannot open policy rank 0's CUDA IPC handle on {device} (GPU {gpu_uuid(device)}, the "
                    f"policy's too): {exc}. Are both processes on this node, and may they share memory "
                    "(same container, or --ipc=host)?"
                ) from exc
        memory = _DeviceRange(pointer, size)
        _free_when_collected(memory, cupy, pointer, False, device)
        return cls(memory, pointer, device, bucket_size, num_slots)

    def view(self, slot: int) -> torch.Tensor:
        return self._views[slot]

    def publish(self) -> None:
        """Wait for the packing copies, so the bytes are in memory before the header leaves."""
        torch.cuda.synchronize(self.device)

    def consumed(self) -> None:
        """Wait for the merge's copies out of the slot, so the policy may overwrite it."""
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Free the allocation (policy) or close the mapping (rollout), never under a live view.
        Idempotent.

        The memory goes when the last view of it dies, after the device finished the work
        queued on it: here, unless a view is still alive. Views caught in reference cycles, such
        as the frames of a failed refit's traceback, are collected here so the memory goes now.
        A view still referenced from outside any cycle (a borrowed tensor kept past
        ``finalize()``, the frames of an exception being handled) keeps the memory until it
        dies: freed or unmapped under it, reading that view would be an illegal address, which
        poisons the process's CUDA context. Host slots, in the same case, put fresh pages under
        the view at once; device memory cannot be replaced so, and stays reserved until then.
        """
        self._views = []
        if self.mapped:
            gc.collect()
