"""How a tensor becomes bytes: the bottom of the library, importing nothing of it but errors.

* Plain-string names for torch dtypes, so dtypes cross process boundaries as JSON, and the
  dtypes that can move as raw bytes (:func:`check_transferable`).
* Is a weight's memory really there? Checked before a single byte of it is read
  (:func:`check_storage`, :func:`check_still_held`). A tensor's metadata can outlive its memory:
  FSDP frees an unsharded parameter's storage with ``untyped_storage().resize_(0)`` and keeps
  the tensor; a ``FakeTensor`` has a ``meta`` storage behind a ``cpu`` device. Reading such a
  tensor's ``data_ptr()`` reads freed or foreign memory: Gloo's ``writev`` fails with "Bad
  address" (SIGABRT), a copy faults (SIGSEGV), and a storage shrunk below its view sends heap
  garbage without an error. So every weight's storage must be real (not ``meta``, a non-null
  pointer) and hold every byte its view addresses.
* A tensor's bytes in C order (:func:`tensor_bytes`).

The contract (``TensorMeta``), the chunking algorithms and the pipeline all build on this
module; it imports none of them, so the layers above never loop through it.
"""

from __future__ import annotations

import functools

import torch

from ckpt_core.errors import UnsupportedTensorError, WireFormatError

# Quantized dtypes carry a scale and zero point outside their bytes: moving the bytes alone
# would silently change the values, so they are refused rather than mangled.
_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


@functools.cache
def _dtypes_by_name() -> dict[str, torch.dtype]:
    names: dict[str, torch.dtype] = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            names.setdefault(dtype_name(value), value)
    return names


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of ``dtype``: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The byte-movable dtype called ``name``; ``WireFormatError`` if there is none."""
    if not isinstance(name, str):
        raise WireFormatError(f"dtype must be a string, got {type(name).__name__}")
    if name in _QUANTIZED:
        raise WireFormatError(
            f"dtype {name!r} is quantized; quantized tensors are never sent as bytes, so a peer "
            "announcing one is malformed"
        )
    try:
        return _dtypes_by_name()[name]
    except KeyError:
        raise WireFormatError(
            f"unknown dtype {name!r}: this torch ({torch.__version__}) has no such dtype; "
            "sender and receiver must run torch versions that share it"
        ) from None


def transferable_dtypes() -> list[torch.dtype]:
    """Every dtype of this torch build whose tensors can be moved as raw bytes."""
    return sorted((d for n, d in _dtypes_by_name().items() if n not in _QUANTIZED), key=dtype_name)


def check_transferable(name: str, tensor: object) -> torch.Tensor:
    """Return ``tensor`` if it can be moved as plain bytes, else raise ``UnsupportedTensorError``."""
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedTensorError(
            f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor; yield (name, tensor) pairs"
        )
    if tensor.is_nested:
        raise UnsupportedTensorError(
            f"weight {name!r} is a nested tensor; its components have different shapes and no "
            "single byte layout: send each component (tensor.unbind()) as a weight of its own"
        )
    if tensor.is_quantized:
        raise UnsupportedTensorError(
            f"weight {name!r} is quantized ({dtype_name(tensor.dtype)}); its scale and zero "
            "point are not part of its bytes: dequantize it, or send int_repr() and the "
            "quantization parameters as separate tensors"
        )
    if tensor.layout != torch.strided:
        raise UnsupportedTensorError(
            f"weight {name!r} has layout {tensor.layout}; only dense (strided) tensors can be "
            "sent: call .to_dense() first"
        )
    if tensor.is_meta:
        raise UnsupportedTensorError(f"weight {name!r} is on the meta device and has no data; materialize it first")
    check_storage(name, tensor)
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's bytes in C order (copying only if non-contiguous)."""
    # Attribute checks first: each op call costs microseconds, and this runs once per tensor.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        # Some dtypes (int1..int7, uint1..uint7) have no copy kernel; an integer view of the
        # same element size has one, and copying it moves exactly the same bytes.
        same_size = _INT_OF_SIZE.get(tensor.dtype.itemsize)
        tensor = (tensor.view(same_size) if same_size is not None else tensor).contiguous()
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
