"""FP8 weight formats an inference engine loads, and quantizers that produce them with the
engine's own arithmetic, so a rollout given these bytes serves what it would have computed
itself from the same high-precision weight.

Three formats, named as vLLM's loaders read them (``float8_e4m3fn``, whose largest finite
value is 448):

* ``PER_CHANNEL``: one scale per output row, ``<module>.weight_scale`` of shape ``[rows, 1]``
  (compressed-tensors' FP8 checkpoints). The arithmetic of vLLM's online
  ``fp8_per_channel``: ``scale = max(amax_row / 448, 1 / (448 * 512))``, then each element
  ``w / scale`` (a true division, in float32), clamped to +-448, rounded to nearest even.
* ``PER_TENSOR``: one scale, ``<module>.weight_scale`` of shape ``[1]``: ``scale = amax / 448``,
  then ``w * (1 / scale)`` (the reciprocal first, as vLLM's static quantization kernel does),
  clamped, rounded. A weight of all zeros gets scale 0 and all-zero bytes; one whose largest
  magnitude is so small (under about 1.3e-36) that the reciprocal overflows is refused. (vLLM's
  CPU build has no kernel for it; the arithmetic is that of its CUDA kernel.)
* ``BLOCK``: one scale per 128x128 block (DeepSeek-V3 and Qwen3 FP8 checkpoints),
  ``<module>.weight_scale_inv`` of shape ``[ceil(rows / 128), ceil(cols / 128)]``: the
  arithmetic of vLLM's ``per_block_cast_to_fp8`` (the edge blocks' amax taken with zero
  padding; ``scale = max(amax, 1e-4) / 448``; ``w * (1 / scale)``, rounded, not clamped).

The weight must be given in the dtype the engine holds it in (its model dtype, bf16 say): the
engine quantizes what it loaded, and a float32 weight would round differently. Tensors must be
2-D and finite; anything else is refused with a :class:`QuantizationError` naming the weight.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator

import torch

from ckpt_core.errors import InvalidArgumentError

__all__ = [
    "BLOCK_SHAPE",
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8Format",
    "Fp8Weight",
    "QuantizationError",
    "quantize",
    "scale_name",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
BLOCK_SHAPE = (128, 128)
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Rows quantized at once: bounds the float32 intermediate (16 Mi elements, 64 MiB) whatever
# the weight's size; every element's result is the same either way.
_CHUNK_ELEMENTS = 16 << 20


class QuantizationError(InvalidArgumentError):
    """A weight cannot be quantized: not finite, not 2-D (or empty), or of a dtype the engine would not
    quantize. The message names the weight."""


class Fp8Format(enum.Enum):
    """Where the scales are and what they are named (see the module docstring)."""

    PER_CHANNEL = "per_channel"
    PER_TENSOR = "per_tensor"
    BLOCK = "block"

    @property
    def scale_suffix(self) -> str:
        """The scale's name next to ``weight``: ``weight_scale``, or ``weight_scale_inv``."""
        return "weight_scale_inv" if self is Fp8Format.BLOCK else "weight_scale"


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """One quantized weight: ``weight`` (``float8_e4m3fn``, the input's shape) and ``scale``
    (float32), to be sent under ``name`` and ``scale_name``."""

    name: str
    weight: torch.Tensor
    scale_name: str
    scale: torch.Tensor


def scale_name(name: str, fmt: Fp8Format) -> str:
    """``layers.0.q_proj.weight`` -> ``layers.0.q_proj.weight_scale`` (or ``weight_scale_inv``)."""
    module, dot, leaf = name.rpartition(".")
    if leaf != "weight":
        raise QuantizationError(f"{name}: only a module's `weight` is quantized (this name ends in {leaf!r})")
    return f"{module}{dot}{fmt.scale_suffix}"


def quantize(name: str, weight: torch.Tensor, fmt: Fp8Format) -> Fp8Weight:
    """``weight`` in ``fmt``, on its own device; see the module docstring for the arithmetic."""
    _check(name, weight)
    if fmt is Fp8Format.PER_CHANNEL:
        q, scale = _per_channel(name, weight)
    elif fmt is Fp8Format.PER_TENSOR:
        q, scale = _per_tensor(name, weight)
    elif fmt is Fp8Format.BLOCK:
        q, scale = _per_block(name, weight)
    else:  # pragma: no cover - an Fp8Format has no other member
        raise QuantizationError(f"{name}: unknown format {fmt!r}")
    return Fp8Weight(name=name, weight=q, scale_name=scale_name(name, fmt), scale=scale)


def _check(name: str, weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor):
        raise QuantizationError(f"{name}: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in _INPUT_DTYPES:
        raise QuantizationError(f"{name}: quantizes bfloat16, float16 or float32 weights, got {weight.dtype}")
    if weight.dim() != 2 or weight.numel() == 0:
        raise QuantizationError(
            f"{name}: quantizes 2-D weights ([rows, cols]) with elements, got shape {list(weight.shape)}"
        )


def _require_finite(name: str, weight: torch.Tensor, amax: torch.Tensor) -> None:
    """Refuse ``weight`` if ``amax`` (its magnitudes' maxima, which carry any inf or NaN) is
    not finite; only then is the whole weight searched, for the message."""
    if bool(torch.isfinite(amax).all()):
        return
    bad = (~torch.isfinite(weight)).nonzero()
    first = [int(i) for i in bad[0]]
    raise QuantizationError(
        f"{name}: {bad.shape[0]} of {weight.numel()} elements are inf or NaN (the first at {first}, "
        f"{weight[tuple(first)].item()}); a scale cannot be derived from them: find where the "
        "trainer produced them"
    )


def _rows_per_chunk(cols: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, cols))


def _amax(weight: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``max |w|`` in the weight's own dtype (exact), without a full-size ``abs()``; NaN where
    a NaN is."""
    if dim is None:
        lo, hi = weight.aminmax()
    else:  # measured: aminmax along a dim of a bf16 weight is ~5x slower than amin and amax
        lo, hi = weight.amin(dim=dim, keepdim=True), weight.amax(dim=dim, keepdim=True)
    return torch.maximum(lo.abs(), hi.abs())


def _row_chunks(weight: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor]]:
    """Slices of rows and a float32 work tensor of their shape, one buffer reused throughout
    (a fresh one per chunk would be mapped and faulted in anew each time)."""
    rows, cols = weight.shape
    step = _rows_per_chunk(cols)
    work = torch.empty((min(step, rows), cols), dtype=torch.float32, device=weight.device)
    for start in range(0, rows, step):
        chunk = slice(start, min(rows, start + step))
        yield chunk, work[: chunk.stop - chunk.start]


def _per_channel(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = _amax(weight, dim=-1)
    _require_finite(name, weight, amax)
    # The maximum as a 0-d float32 tensor: dividing by it is a true division, which a Python
    # float divisor would lower to a multiplication by its reciprocal.
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=weight.device)
    scale = (amax.to(torch.float32) / fp8_max).clamp_min(1.0 / (fp8_max * 512))
    out = torch.empty_like(weight, dtype=FP8_DTYPE)
    for rows, work in _row_chunks(weight):
        torch.div(weight[rows], scale[rows], out=work)  # in float32, as `weight / scale` is
        out[rows].copy_(work.clamp_(-FP8_MAX, FP8_MAX))
    return out, scale


def _per_tensor(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = _amax(weight)
    _require_finite(name, weight, amax)
    fp8_max = torch.tensor(FP8_MAX, dtype=torch.float32, device=weight.device)
    scale = (amax.to(torch.float32) / fp8_max).reshape(1)
    out = torch.empty_like(weight, dtype=FP8_DTYPE)
    if float(scale) == 0.0:  # all zeros: 0 * (1 / 0) would be NaN
        out.zero_()
        return out, scale
    inverse = 1.0 / scale
    if not bool(torch.isfinite(inverse).all()):
        raise QuantizationError(
            f"{name}: per-tensor FP8 cannot hold this weight: its largest magnitude, {float(amax):.3g}, makes "
            "the scale's reciprocal overflow float32, which would saturate every element (vLLM's kernel "
            "multiplies by it too): use per-channel or block scales for it"
        )
    for rows, work in _row_chunks(weight):
        torch.mul(weight[rows], inverse, out=work)
        out[rows].copy_(work.clamp_(-FP8_MAX, FP8_MAX))
    return out, scale


def _per_block(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    block_rows, block_cols = BLOCK_SHAPE
    rows, cols = weight.shape
    bands, blocks = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    out = torch.empty_like(weight, dtype=FP8_DTYPE)
    scale = torch.empty((bands, blocks), dtype=torch.float32, device=weight.device)
    step = max(1, _rows_per_chunk(blocks * block_cols) // block_rows)  # whole bands at a time
    for first in range(0, bands, step):
        last = min(bands, first + step)
        top, bottom = first * block_rows, min(rows, last * block_rows)
        padded = torch.zeros(
            ((last - first) * block_rows, blocks * block_cols), dtype=weight.dtype, device=weight.device
        )
        padded[: bottom - top, :cols] = weight[top:bottom]
        view = padded.view(last - first, block_rows, blocks, block_cols)
        amax = view.abs().float().amax(dim=(1, 3), keepdim=True)
        _require_finite(name, weight, amax)
        factor = amax.clamp(1e-4) / FP8_MAX
        out[top:bottom].copy_((view * (1.0 / factor)).view_as(padded)[: bottom - top, :cols])
        scale[first:last] = factor.view(last - first, blocks)
    return out, scale
