"""Quantize-on-send: what a rollout holds quantized, and the sender's stage that turns its
weights into what that rollout loads.

A rollout that serves FP8 describes it as plain JSON data in its ``prepare()`` metadata, under
``"weight_quantization"``; a sender with ``quantize_for_rollout=True`` quantizes each weight it
names before a byte is packed (:func:`quantize_weights`), so every backend has it. The format
(version 1)::

    {
      "format": "ckpt-engine.weight-quantization",
      "version": 1,
      "dtype": "bfloat16",
      "fp8": "per_channel",
      "weights": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    }

``dtype`` is the rollout's model dtype: a weight is cast to it first (as the rollout's loader
would cast it), then quantized with the rollout's own arithmetic (:mod:`ckpt_core.refit.quantize.fp8`,
``fp8`` naming an :class:`~ckpt_core.refit.quantize.fp8.Fp8Format`). Each named weight is sent as its FP8
bytes under its own name, followed by its scale (``<module>.weight_scale``, or
``weight_scale_inv`` for blocks); every other weight is sent as it was yielded. A named weight
the sender never yields is an error at the end of the refit, as is a yielded scale name (the
stage makes the scales).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterable, Mapping
from typing import Any

import torch

from ckpt_core.refit.quantize.fp8 import Fp8Format, QuantizationError, quantize, scale_name

__all__ = ["QuantizationSpec", "SPEC_FORMAT", "SPEC_VERSION", "quantize_weights"]

SPEC_FORMAT = "ckpt-engine.weight-quantization"
SPEC_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class QuantizationSpec:
    """A rollout's ``"weight_quantization"``, parsed: the model dtype, the FP8 format, and the
    names of the weights it holds quantized."""

    dtype: torch.dtype
    fmt: Fp8Format
    weights: frozenset[str]

    @classmethod
    def from_json(cls, data: Any, *, owner: str) -> QuantizationSpec:
        """Parse and check ``data``; ``owner`` names its source in every error."""
        if not isinstance(data, Mapping):
            raise QuantizationError(f"{owner}: a weight quantization must be a mapping, got {type(data).__name__}")
        if data.get("format") != SPEC_FORMAT or data.get("version") != SPEC_VERSION:
            raise QuantizationError(
                f"{owner}: expected format {SPEC_FORMAT!r} version {SPEC_VERSION}, got "
                f"{data.get('format')!r} version {data.get('version')!r}"
            )
        unknown = sorted(set(data) - {"format", "version", "dtype", "fp8", "weights"})
        if unknown:
            raise QuantizationError(f"{owner}: unknown keys {unknown}")
        dtype = _DTYPES.get(data.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise QuantizationError(f"{owner}: 'dtype' must be one of {sorted(_DTYPES)}, got {data.get('dtype')!r}")
        try:
            fmt = Fp8Format(data.get("fp8"))
        except ValueError:
            choices = [f.value for f in Fp8Format]
            raise QuantizationError(f"{owner}: 'fp8' must be one of {choices}, got {data.get('fp8')!r}") from None
        names = data.get("weights")
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
            raise QuantizationError(f"{owner}: 'weights' must be a non-empty list of weight names")
        if len(set(names)) != len(names):
            raise QuantizationError(f"{owner}: 'weights' names a weight twice")
        for name in names:
            try:
                scale_name(name, fmt)  # each must be a module's `weight`
            except QuantizationError as exc:
                raise QuantizationError(f"{owner}: {exc}") from None
        return cls(dtype=dtype, fmt=fmt, weights=frozenset(names))

    def to_json(self) -> dict[str, Any]:
        dtype = next(key for key, value in _DTYPES.items() if value == self.dtype)
        return {
            "format": SPEC_FORMAT,
            "version": SPEC_VERSION,
            "dtype": dtype,
            "fp8": self.fmt.value,
            "weights": sorted(self.weights),
        }


def quantize_weights(
    weights: Iterable[tuple[str, torch.Tensor]], spec: QuantizationSpec, *, destination: str
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``weights`` as ``spec``'s rollout loads them (see the module docstring); ``destination``
    names the rollout in errors."""
    scales = {scale_name(name, spec.fmt): name for name in spec.weights}
    seen: set[str] = set()
    for name, tensor in weights:
        if name in scales:
            raise QuantizationError(
                f"{destination}: the sender yielded {name!r}, the scale of {scales[name]!r}, which quantize-on-send "
                "makes itself: yield the high-precision weight only"
            )
        if name not in spec.weights:
            yield name, tensor
            continue
        seen.add(name)
        loaded = tensor if tensor.dtype == spec.dtype else tensor.to(spec.dtype)
        quantized = quantize(name, loaded, spec.fmt)
        del loaded
        yield name, quantized.weight
        yield quantized.scale_name, quantized.scale
    missing = spec.weights - seen
    if missing:
        shown = ", ".join(sorted(missing)[:5]) + (" ..." if len(missing) > 5 else "")
        raise QuantizationError(
            f"{destination}: holds {len(missing)} weight(s) quantized that the sender never yielded ({shown}): "
            "the refit would leave them at their old values"
        )
