"""``ckpt_core.refit.quantize.fp8`` against vLLM's own quantizers, byte for byte: what an FP8 rollout would
compute itself from the same weight is what a quantizing sender sends it.

The references are vLLM's functions (0.32): for per-channel scales, those of its online
``fp8_per_channel`` (``weight_amax``, ``_fp8_channel_scale``, ``_fp8_quant_per_channel`` in
``vllm.model_executor.layers.quantization.online.fp8``); for 128x128 blocks,
``vllm.utils.deep_gemm.per_block_cast_to_fp8``. Per-tensor scales go through vLLM's
``scaled_fp8_quant`` kernel, which its CPU build lacks (the op is a stub there): that
comparison runs where vLLM's CUDA build and a GPU are, and is skipped otherwise. (It is not a
``gpu`` test: scripts/gpu_check.sh runs on a machine without vLLM.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ckpt_core.refit.quantize.fp8 import Fp8Format, quantize

pytest.importorskip("vllm")


def weights() -> dict[str, torch.Tensor]:
    """Random weights and adversarial ones, bf16 as a rollout holds them."""
    generator = torch.Generator().manual_seed(11)
    cases = {
        "random 256x512": torch.randn(256, 512, generator=generator),
        "random 200x300 (edge blocks)": torch.randn(200, 300, generator=generator) * 0.02,
        "random 1x7": torch.randn(1, 7, generator=generator),
        "rows over six decades": torch.randn(64, 384, generator=generator) * torch.logspace(-4, 2, 64)[:, None],
        "zeros": torch.zeros(130, 260),
    }
    outlier = torch.randn(128, 256, generator=generator) * 0.01
    outlier[5, 200] = 3e4
    cases["one huge outlier"] = outlier
    # bf16 subnormals, and rows under the per-channel scale's floor (amax < 448 / (448 * 512))
    cases["subnormals and tiny rows"] = torch.cat(
        [
            torch.full((2, 256), 1e-39),
            torch.randn(2, 256, generator=generator) * 1e-4,
            torch.randn(4, 256, generator=generator),
        ]
    )
    # Values on the midpoint between two FP8 values once scaled (amax 448: scale exactly 1),
    # where rounding to nearest even decides.
    ties = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 3.125, -3.375, 0.0078125, 240.0])
    cases["ties"] = ties.repeat(4, 32)
    return {name: w.to(torch.bfloat16) for name, w in cases.items()}


CASES = weights()


def vllm_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    scale = online._fp8_channel_scale(weight_amax(weight, dim=-1, keepdim=True))
    return online._fp8_quant_per_channel(weight, scale), scale


def vllm_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8(weight, block_size=[128, 128], use_ue8m0=False)


def assert_same_bytes(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (
        f"{what}: {ours.dtype} {ours.shape} != {theirs.dtype} {theirs.shape}"
    )
    differ = ours.contiguous().view(torch.uint8) != theirs.contiguous().view(torch.uint8)
    assert not bool(differ.any()), (
        f"{what}: {int(differ.sum())} of {ours.numel()} bytes differ, the first at {differ.nonzero()[0].tolist()}"
    )


@pytest.mark.parametrize(
    ("fmt", "reference"),
    [(Fp8Format.PER_CHANNEL, vllm_per_channel), (Fp8Format.BLOCK, vllm_block)],
    ids=["per_channel", "block"],
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bytes_and_scales_equal_vllms(
    fmt: Fp8Format, reference: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], case: str
) -> None:
    weight = CASES[case]
    ours = quantize("model.layers.0.mlp.down_proj.weight", weight, fmt)
    q, scale = reference(weight)
    assert_same_bytes(ours.weight, q, f"{case}: weight")
    assert_same_bytes(ours.scale, scale.to(torch.float32).reshape(ours.scale.shape), f"{case}: scale")


@pytest.mark.parametrize("case", sorted(set(CASES) - {"subnormals and tiny rows"}))
def test_per_tensor_equals_vllms_kernel(case: str) -> None:
    """On CUDA: vLLM's ``scaled_fp8_quant`` with the scale vLLM's online per-tensor method
    derives (``amax / 448``). All zeros are left out: the kernel then multiplies by an infinite
    reciprocal, and its bytes (whatever they are) dequantize to zeros, as ours (zeros) do; so
    are weights whose reciprocal overflows, which ``quantize`` refuses."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA and vLLM's CUDA build (its CPU build has no per-tensor FP8 kernel)")
    from vllm import _custom_ops as ops

    weight = CASES[case].cuda()
    if not bool(weight.any()):
        pytest.skip("all zeros: see the docstring")
    ours = quantize("model.layers.0.mlp.down_proj.weight", weight, Fp8Format.PER_TENSOR)
    q, _ = ops.scaled_fp8_quant(weight, scale=ours.scale)
    assert_same_bytes(ours.weight, q, f"{case}: weight")
    amax = weight.abs().max().to(torch.float32)
    assert_same_bytes(ours.scale, (amax / torch.tensor(448.0, device="cuda")).reshape(1), f"{case}: scale")
