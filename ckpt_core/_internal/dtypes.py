"""Plain-string names for torch dtypes, so dtypes cross process boundaries as JSON."""

from __future__ import annotations

import functools

import torch

from ckpt_core._internal.storage_check import check_storage
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
