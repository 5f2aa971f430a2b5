"""Is a weight's memory really there? Checked before a single byte of it is read.

A tensor's metadata can outlive its memory: FSDP frees an unsharded parameter's storage with
``untyped_storage().resize_(0)`` and keeps the tensor; a ``FakeTensor`` has a ``meta``
storage behind a ``cpu`` device. Reading such a tensor's ``data_ptr()`` reads freed or foreign
memory: Gloo's ``writev`` fails with "Bad address" (SIGABRT), a copy faults (SIGSEGV), and a
storage shrunk below its view sends heap garbage without an error. So every weight's storage
must be real (not ``meta``, a non-null pointer) and hold every byte its view addresses.
"""

from __future__ import annotations

import torch

from ckpt_core.errors import UnsupportedTensorError

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def check_storage(name: str, tensor: torch.Tensor) -> None:
    """``UnsupportedTensorError`` unless ``tensor``'s storage holds every byte it views."""
    numel = tensor.numel()
    if numel == 0:
        return
    try:
        storage = tensor.untyped_storage()
        offset = tensor.storage_offset()
        # A plain tensor's storage is on the tensor's own device, which is cheap to ask; only a
        # subclass (a FakeTensor is a cpu tensor over a meta storage) needs its storage asked,
        # which costs a device object per weight.
        on_meta = tensor.is_meta if type(tensor) in _PLAIN else storage.device.type == "meta"
        available = storage.nbytes()
        address = 0 if on_meta else storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError) as exc:  # a wrapper subclass (DTensor, ...)
        raise UnsupportedTensorError(
            f"weight {name!r} ({type(tensor).__name__}) has no storage of its own "
            f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); yield a plain tensor "
            "(for a DTensor: its full_tensor() or to_local())"
        ) from exc
    if on_meta:
        raise UnsupportedTensorError(
            f"weight {name!r} ({type(tensor).__name__}) has no data: its storage is on the meta "
            "device (a FakeTensor or a meta tensor); yield a materialized tensor"
        )
    needed = _bytes_viewed(tensor, int(offset))
    if available < needed or address == 0:
        freed = " (it was freed: resize_(0), as FSDP does to unsharded parameters)" if available == 0 else ""
        raise UnsupportedTensorError(
            f"weight {name!r} views {needed} bytes of its storage, which holds {available}{freed}; "
            "yield the weight while its storage is allocated (e.g. inside FSDP's summon_full_params "
            "or after unsharding), never after freeing it"
        )


def check_still_held(name: str, tensor: torch.Tensor) -> None:
    """``UnsupportedTensorError`` unless ``tensor`` (a plain tensor :func:`check_storage`
    accepted when it was yielded) still has the memory it views: checked where the sender
    reads a weight's bytes after the generator has gone on (a direct chunk, posted with its
    bucket), since a generator may free a weight's storage once it yielded the next one."""
    if tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    if storage.data_ptr() and storage.nbytes() >= _bytes_viewed(tensor, int(tensor.storage_offset())):
        return
    raise UnsupportedTensorError(
        f"weight {name!r} was freed (its storage now holds {storage.nbytes()} bytes) after it was yielded "
        "and before the sender read it: a weight sent direct (a chunk of 1 MiB or more) is read until its "
        "bucket's transfer completes, so keep each weight's storage allocated and its bytes unchanged until "
        "the weights yielded after it hold more than two buckets' bytes (docs/reliability.md, 'The weights "
        "generator'), or yield a copy (clone()) of a weight whose storage the generator frees or reuses"
    )


def _bytes_viewed(tensor: torch.Tensor, offset: int) -> int:
    """Bytes of its storage that ``tensor`` (of at least one element) addresses, from the start."""
    if tensor.is_contiguous():
        last = tensor.numel() - 1
    else:
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (offset + last + 1) * tensor.dtype.itemsize
