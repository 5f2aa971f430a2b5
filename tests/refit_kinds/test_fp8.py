"""``ckpt_core.refit.quantize.fp8``: the formats' names and shapes, what every quantized element may differ
from its weight by, the edge cases (zeros, an outlier, subnormals, shapes that are not
multiples of a block) and the refusals. Bit-identity with vLLM's own quantizers is checked
where vLLM is installed (integrations/vllm/tests/test_fp8_reference.py)."""

from __future__ import annotations

import pytest
import torch

from ckpt_core.refit.quantize import fp8
from ckpt_core.refit.quantize.fp8 import FP8_MAX, Fp8Format, QuantizationError, quantize, scale_name

FORMATS = list(Fp8Format)
# float8_e4m3fn: 3 mantissa bits (a normal value rounds to within 2^-4 of itself, relatively);
# subnormals step by 2^-9, so they round to within 2^-10 (times the scale).
RELATIVE, ABSOLUTE = 2.0**-4, 2.0**-10


def dequantized(q: fp8.Fp8Weight, fmt: Fp8Format) -> torch.Tensor:
    values = q.weight.to(torch.float64)
    if fmt is Fp8Format.BLOCK:
        rows, cols = values.shape
        scale = q.scale.to(torch.float64).repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        return values * scale
    return values * q.scale.to(torch.float64)


def element_scale(q: fp8.Fp8Weight, fmt: Fp8Format, shape: torch.Size) -> torch.Tensor:
    if fmt is Fp8Format.BLOCK:
        return q.scale.to(torch.float64).repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    return q.scale.to(torch.float64).expand(shape)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(256, 512), (200, 300), (1, 7), (129, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_element_within_half_a_step(fmt: Fp8Format, shape: tuple[int, int], dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    weight = (torch.randn(shape, generator=generator) * torch.logspace(-3, 1, shape[1])).to(dtype)
    q = quantize("model.layers.0.mlp.up_proj.weight", weight, fmt)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight.shape == weight.shape
    assert q.scale.dtype == torch.float32
    expected_scale_shape = {
        Fp8Format.PER_CHANNEL: (shape[0], 1),
        Fp8Format.PER_TENSOR: (1,),
        Fp8Format.BLOCK: (-(-shape[0] // 128), -(-shape[1] // 128)),
    }[fmt]
    assert tuple(q.scale.shape) == expected_scale_shape
    exact = weight.to(torch.float64)
    bound = torch.maximum(exact.abs() * RELATIVE, element_scale(q, fmt, weight.shape) * ABSOLUTE)
    error = (dequantized(q, fmt) - exact).abs()
    assert bool((error <= bound * (1 + 1e-6)).all()), f"largest error over its bound: {(error / bound).max():.3f}"


@pytest.mark.parametrize("fmt", [Fp8Format.PER_CHANNEL, Fp8Format.PER_TENSOR])
def test_the_largest_magnitude_becomes_448(fmt: Fp8Format) -> None:
    weight = torch.tensor([[0.5, -3.0, 1.0], [2.0, 0.25, -0.125]], dtype=torch.bfloat16)
    q = quantize("w.weight", weight, fmt).weight.to(torch.float32)
    if fmt is Fp8Format.PER_CHANNEL:
        assert q[0, 1] == -FP8_MAX and q[1, 0] == FP8_MAX
    else:
        assert q[0, 1] == -FP8_MAX and q.abs().max() == FP8_MAX


def test_names_of_the_scales() -> None:
    assert scale_name("model.layers.3.self_attn.q_proj.weight", Fp8Format.PER_CHANNEL) == (
        "model.layers.3.self_attn.q_proj.weight_scale"
    )
    assert scale_name("lm.weight", Fp8Format.PER_TENSOR) == "lm.weight_scale"
    assert scale_name("q_proj.weight", Fp8Format.BLOCK) == "q_proj.weight_scale_inv"
    with pytest.raises(QuantizationError, match="q_proj.bias"):
        scale_name("q_proj.bias", Fp8Format.PER_CHANNEL)


def test_all_zeros() -> None:
    zeros = torch.zeros(130, 260, dtype=torch.bfloat16)
    for fmt in FORMATS:
        q = quantize("z.weight", zeros, fmt)
        assert not bool(q.weight.view(torch.uint8).any()), fmt
        assert bool(torch.isfinite(q.scale).all()), fmt
    per_tensor = quantize("z.weight", zeros, Fp8Format.PER_TENSOR)
    assert float(per_tensor.scale) == 0.0
    per_channel = quantize("z.weight", zeros, Fp8Format.PER_CHANNEL)  # the scale's floor
    assert torch.equal(per_channel.scale, torch.full((130, 1), 1.0 / (FP8_MAX * 512), dtype=torch.float32))


def test_one_huge_outlier_takes_the_range() -> None:
    weight = torch.full((4, 256), 0.1, dtype=torch.bfloat16)
    weight[2, 17] = 1e30
    per_tensor = quantize("o.weight", weight, Fp8Format.PER_TENSOR)
    assert per_tensor.weight[2, 17].float() == FP8_MAX
    assert not bool(per_tensor.weight.view(torch.uint8)[0].any())  # 0.1 is under half a step: zero
    per_channel = quantize("o.weight", weight, Fp8Format.PER_CHANNEL)
    assert bool((per_channel.weight[0].float() == FP8_MAX).all())  # other rows keep their own range
    block = quantize("o.weight", weight, Fp8Format.BLOCK)
    assert bool((block.weight[:, 128:].float() == FP8_MAX).all())  # the other block too


def test_subnormal_weights() -> None:
    tiny = torch.tensor([[1e-39, -2e-39, 5e-40, 0.0]], dtype=torch.bfloat16)  # bf16 subnormals
    assert bool((tiny != 0).any()) and float(tiny.abs().max()) < torch.finfo(torch.bfloat16).tiny
    for fmt in (Fp8Format.PER_CHANNEL, Fp8Format.BLOCK):  # their scales have a floor
        q = quantize("s.weight", tiny, fmt)
        assert bool(torch.isfinite(q.weight.float()).all()) and bool(torch.isfinite(q.scale).all()), fmt
    # Per tensor, 1 / (2e-39 / 448) overflows float32: every element would saturate.
    with pytest.raises(
        QuantizationError, match=r"s\.weight: per-tensor FP8 cannot hold this weight: its largest magnitude, 2.02e-39"
    ):
        quantize("s.weight", tiny, Fp8Format.PER_TENSOR)
    # Just above where it overflows, the largest magnitude becomes 448 and the rest keep their ratios.
    small = torch.tensor([[1e-35, -2e-35, 0.0]], dtype=torch.bfloat16)
    q = quantize("s.weight", small, Fp8Format.PER_TENSOR)
    assert q.weight[0, 1].float() == -FP8_MAX and q.weight[0, 0].float() == FP8_MAX / 2


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_weights_are_refused_by_name(bad: float) -> None:
    weight = torch.ones(3, 5, dtype=torch.bfloat16)
    weight[1, 3] = bad
    weight[2, 0] = bad
    for fmt in FORMATS:
        with pytest.raises(
            QuantizationError,
            match=r"layers\.1\.o_proj\.weight: 2 of 15 elements are inf or NaN \(the first at \[1, 3\]",
        ):
            quantize("layers.1.o_proj.weight", weight, fmt)


@pytest.mark.parametrize(
    ("weight", "said"),
    [
        (torch.ones(4, dtype=torch.bfloat16), "2-D"),
        (torch.ones(2, 3, 4, dtype=torch.bfloat16), "2-D"),
        (torch.ones(5, 0, dtype=torch.bfloat16), "with elements, got shape \\[5, 0\\]"),
        (torch.ones(2, 2, dtype=torch.int32), "bfloat16, float16 or float32"),
        (torch.ones(2, 2, dtype=torch.float8_e4m3fn), "bfloat16, float16 or float32"),
        ([[1.0]], "torch.Tensor"),
    ],
)
def test_what_is_not_quantized(weight: object, said: str) -> None:
    with pytest.raises(QuantizationError, match=f"x.weight: .*{said}"):
        quantize("x.weight", weight, Fp8Format.PER_CHANNEL)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", FORMATS)
def test_chunks_do_not_change_a_byte(fmt: Fp8Format, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large weights are quantized some rows at a time (to bound the float32 intermediate):
    with chunks of a few rows, the bytes and scales are those of one pass."""
    weight = torch.randn(300, 260, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = quantize("c.weight", weight, fmt)
    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 3 * 260)
    chunked = quantize("c.weight", weight, fmt)
    assert torch.equal(whole.weight.view(torch.uint8), chunked.weight.view(torch.uint8))
    assert torch.equal(whole.scale, chunked.scale)
