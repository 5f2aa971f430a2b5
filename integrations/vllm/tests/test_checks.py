"""Checks of the adapter that need no vLLM engine: the checkpoint's names of layers vLLM
wrapped for LoRA, ``full_weight`` against this rank's layout, the experts' layouts in
shardings vLLM's CPU build cannot run, ``VllmRollout``'s arguments, refused before the
engine is called, ``init_info`` as vLLM passes it on, and the import paths vLLM and users
resolve by name. The trainer side is checked against vLLM 0.33's own base classes too."""

from __future__ import annotations

import importlib
import math
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ckpt_core.errors import EngineOptionError, InvalidArgumentError, UnknownBackendError, WeightLayoutError
from ckpt_core.refit.layout import KeptWeight, WeightLayout, check_layouts, nothing, select_weights, slices, whole
from ckpt_core.refit.quantize.fp8 import Fp8Format, quantize
from ckpt_vllm import RolloutLoadError, VllmRollout
from ckpt_vllm.model.loading import checkpoint_name
from ckpt_vllm.model.model_layout import _expert_weights, full_weight, scale_kept

# --- names of layers vLLM wrapped to serve LoRA -----------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.0.self_attn.qkv_proj.base_layer.weight", "model.layers.0.self_attn.qkv_proj.weight"),
        ("model.layers.0.self_attn.qkv_proj.base_layer", "model.layers.0.self_attn.qkv_proj"),
        ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
        ("model.base_layers.0.weight", "model.base_layers.0.weight"),
    ],
)
def test_a_wrapped_layer_is_named_as_the_checkpoint_names_it(name: str, expected: str) -> None:
    assert checkpoint_name(name) == expected


# --- full_weight ---------------------------------------------------------------------------


def test_full_weight_puts_three_dimensional_parts_where_they_belong() -> None:
    """A fused experts tensor [E, 2 * I, H] of which the rank received its rows of the gate
    half and of the up half: they land at their offsets, in the order received."""
    full = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4, 8, 3)
    kept = slices(full.shape, 1, [(2, 2), (6, 2)])
    received = torch.cat([full[:, 2:4], full[:, 6:8]], dim=1)
    rebuilt = full_weight("experts.gate_up_proj", received, kept)
    assert rebuilt.shape == full.shape
    assert torch.equal(rebuilt[:, 2:4], full[:, 2:4]) and torch.equal(rebuilt[:, 6:8], full[:, 6:8])
    experts = slices(full.shape, 0, [(3, 1), (0, 1)])  # parts in the order received
    rebuilt = full_weight("experts.down_proj", torch.cat([full[3:4], full[0:1]]), experts)
    assert torch.equal(rebuilt[3], full[3]) and torch.equal(rebuilt[0], full[0])
    whole_tensor = torch.ones(2, 3)
    assert full_weight("norm.weight", whole_tensor, whole((2, 3))) is whole_tensor


@pytest.mark.parametrize(
    ("kept", "received", "message"),
    [
        (
            slices((4, 8, 3), 1, [(2, 2), (6, 2)]),
            (4, 8, 3),
            "shape [4, 8, 3], but this rank's layout says it receives shape [4, 4, 3] (of the full [4, 8, 3])",
        ),
        (whole((8, 3)), (4, 3), "shape [4, 3], but this rank's layout says it receives shape [8, 3]"),
        (nothing((8, 3)), (8, 3), "this rank's layout says it receives none of it"),
    ],
    ids=["whole_weight_for_a_slice", "a_slice_for_a_whole_weight", "a_weight_the_rank_keeps_none_of"],
)
def test_full_weight_refuses_a_tensor_of_another_shape_naming_the_weight(
    kept: Any, received: tuple[int, ...], message: str
) -> None:
    """What a sender that ignored the layout (shard_expert_weights on one side only) sends."""
    with pytest.raises(RolloutLoadError, match="received weight 'model.layers.0.w'") as caught:
        full_weight("model.layers.0.w", torch.zeros(received), kept)
    assert message in str(caught.value)
    assert "same shard_expert_weights" in str(caught.value)


# --- experts' layouts, fused and per expert -------------------------------------------------

EXPERTS, INTER, HIDDEN, PREFIX = 4, 8, 6, "model.layers.0.mlp.experts"


def routed_experts(tp: tuple[int, int], local: list[int], transposed: bool) -> Any:
    """The attributes of vLLM 0.32's ``RoutedExperts`` that the layout reads, for a sharding
    its CPU build cannot run (expert parallelism kills its workers; no CPU model is
    transposed). The tensor-parallel case on a real engine: test_vllm_moe.py."""
    tp_rank, tp_size = tp
    return SimpleNamespace(
        moe_config=SimpleNamespace(moe_parallel_config=SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size)),
        intermediate_size_per_partition=INTER // tp_size,
        hidden_size=HIDDEN,
        global_num_experts=EXPERTS,
        expert_map_manager=SimpleNamespace(is_local_expert=lambda expert: expert in local),
        is_fused_checkpoint_transposed=transposed,
    )


def layout_of(module: Any) -> WeightLayout:
    per_expert, alternatives = _expert_weights(PREFIX, module)
    return WeightLayout.from_json(WeightLayout(per_expert, tuple(alternatives)).to_json())


def numbered_experts(transposed: bool) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The experts fused (every element a distinct number) and the same elements per expert."""
    gate_up = torch.arange(EXPERTS * 2 * INTER * HIDDEN).reshape(EXPERTS, 2 * INTER, HIDDEN)
    down = torch.arange(EXPERTS * HIDDEN * INTER).reshape(EXPERTS, HIDDEN, INTER) + gate_up.numel()
    per_expert = []
    for e in range(EXPERTS):
        per_expert += [
            (f"{PREFIX}.{e}.gate_proj.weight", gate_up[e, :INTER]),
            (f"{PREFIX}.{e}.up_proj.weight", gate_up[e, INTER:]),
            (f"{PREFIX}.{e}.down_proj.weight", down[e]),
        ]
    if transposed:
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return [(f"{PREFIX}.gate_up_proj", gate_up), (f"{PREFIX}.down_proj", down)], per_expert


@pytest.mark.parametrize("transposed", [False, True], ids=["fused", "fused_transposed"])
@pytest.mark.parametrize(
    "ranks",
    [
        [((0, 2), [0, 1, 2, 3]), ((1, 2), [0, 1, 2, 3])],  # tensor-parallel 2
        [((0, 1), [0, 1]), ((0, 1), [2, 3])],  # expert-parallel 2, linear placement
        [((0, 1), [0, 2]), ((0, 1), [1, 3])],  # expert-parallel 2, round robin
        [((0, 1), [0, 1, 2, 3])],  # one rank
    ],
    ids=["tp2", "ep2_linear", "ep2_round_robin", "tp1"],
)
def test_each_rank_keeps_the_same_elements_of_fused_experts_as_of_per_expert_ones(
    ranks: list[tuple[tuple[int, int], list[int]]], transposed: bool
) -> None:
    fused, per_expert = numbered_experts(transposed)
    layouts = {index: layout_of(routed_experts(tp, local, transposed)) for index, (tp, local) in enumerate(ranks)}
    check_layouts(layouts, owner="test")  # every element of either naming reaches some rank
    for index, layout in layouts.items():
        from_fused = torch.cat([t.flatten() for _, t in select_weights(fused, layout, destination="r")])
        from_experts = torch.cat([t.flatten() for _, t in select_weights(per_expert, layout, destination="r")])
        assert torch.equal(from_fused.sort().values, from_experts.sort().values), f"rank {index}"
        assert from_fused.numel() == layout.received_elements()
        for name, tensor in select_weights(fused, layout, destination="r"):  # full_weight rebuilds its parts
            kept = layout.find(name)
            assert kept is not None and full_weight(name, tensor, kept).shape == kept.shape


def test_experts_sharded_by_expert_and_tensor_parallel_at_once_are_refused() -> None:
    with pytest.raises(WeightLayoutError, match=f"{PREFIX}: this rank holds 2 of 4 experts and a tensor-parallel"):
        _expert_weights(PREFIX, routed_experts((1, 2), [2, 3], transposed=False))


# --- VllmRollout's arguments ---------------------------------------------------------------

GOOD: dict[str, Any] = {"backend": "gloo_cpu", "bucket_size_bytes": 1 << 20}


@pytest.mark.parametrize(
    ("bad", "error", "message"),
    [
        ({"rpc_timeout_s": "10"}, EngineOptionError, "rpc_timeout_s must be a finite number > 0, got '10'"),
        ({"rpc_timeout_s": math.nan}, EngineOptionError, "rpc_timeout_s must be a finite number > 0, got nan"),
        ({"rpc_timeout_s": math.inf}, EngineOptionError, "rpc_timeout_s must be a finite number > 0, got inf"),
        ({"rpc_timeout_s": 0}, EngineOptionError, "rpc_timeout_s must be a finite number > 0, got 0"),
        ({"rpc_timeout_s": 1e12}, EngineOptionError, "rpc_timeout_s must be at most"),
        ({"rpc_timeout_s": True}, EngineOptionError, "rpc_timeout_s must be a finite number > 0, got True"),
        ({"rank_offset": "2"}, EngineOptionError, "rank_offset must be an int >= 0, got '2'"),
        ({"rank_offset": -3}, EngineOptionError, "rank_offset must be an int >= 0, got -3"),
        ({"rank_offset": True}, EngineOptionError, "rank_offset must be an int >= 0, got True"),
        ({"rank_offset": 1.0}, EngineOptionError, "rank_offset must be an int >= 0, got 1.0"),
        ({"host_pool_bytes": -1}, EngineOptionError, "host_pool_bytes must be an int >= 0, got -1"),
        ({"host_pool_bytes": "1GiB"}, EngineOptionError, "host_pool_bytes must be an int >= 0, got '1GiB'"),
        ({"verify": "yes"}, EngineOptionError, "verify must be True or False, got 'yes'"),
        ({"verify": 1}, EngineOptionError, "verify must be True or False, got 1"),
        ({"engine_kwargs": [("timeout_s", 5)]}, EngineOptionError, "engine_kwargs must be a dict"),
        ({"engine_kwargs": {1: 2}}, EngineOptionError, "engine_kwargs must be a dict of option name (str)"),
        ({"backend": ""}, UnknownBackendError, "backend must be a non-empty string, got ''"),
        ({"backend": None}, UnknownBackendError, "backend must be a non-empty string, got None"),
        ({"bucket_size_bytes": 0}, EngineOptionError, "bucket_size_bytes must be a positive int (bytes), got 0"),
        ({"bucket_size_bytes": "1MiB"}, EngineOptionError, "bucket_size_bytes must be a positive int"),
        ({"bucket_size_bytes": True}, EngineOptionError, "bucket_size_bytes must be a positive int"),
    ],
    ids=lambda value: str(value) if not isinstance(value, type) else value.__name__,
)
def test_a_bad_argument_is_refused_before_the_engine_is_called(
    bad: dict[str, Any], error: type[Exception], message: str
) -> None:
    """``llm`` is ``None`` here: every other argument is checked before it is used."""
    with pytest.raises(error) as caught:
        VllmRollout(None, **{**GOOD, **bad})
    assert message in str(caught.value) and "VllmRollout" in str(caught.value), caught.value


def test_an_llm_without_collective_rpc_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"llm must be a vllm.LLM built with \*\*VLLM_ENGINE_ARGS"):
        VllmRollout(object(), **GOOD)


# --- the weight quantization a worker publishes --------------------------------------------


def fp8_layout(scales: dict[str, tuple[int, ...]]) -> WeightLayout:
    """A model's checkpoint weights as its layout lists them: two projections, a norm, the
    head, and the given scales."""
    shapes: dict[str, tuple[int, ...]] = {
        "layers.0.q_proj.weight": (256, 200),
        "layers.0.down_proj.weight": (200, 512),
        "layers.0.norm.weight": (200,),
        "lm_head.weight": (1000, 200),
        **scales,
    }
    return WeightLayout({name: whole(shape) for name, shape in shapes.items()})


@pytest.mark.parametrize(
    ("scales", "fmt"),
    [
        ({"layers.0.q_proj.weight_scale": (256, 1), "layers.0.down_proj.weight_scale": (200, 1)}, "per_channel"),
        ({"layers.0.q_proj.weight_scale": (1,), "layers.0.down_proj.weight_scale": ()}, "per_tensor"),
        ({"layers.0.q_proj.weight_scale_inv": (2, 2), "layers.0.down_proj.weight_scale_inv": (2, 4)}, "block"),
    ],
)
def test_a_workers_quantization_is_read_off_its_scales(scales: dict[str, tuple[int, ...]], fmt: str) -> None:
    from ckpt_vllm.model.model_quantization import derive_weight_quantization

    spec = derive_weight_quantization(fp8_layout(scales), torch.bfloat16)
    assert spec is not None and spec.fmt.value == fmt and spec.dtype == torch.bfloat16
    assert spec.weights == {"layers.0.q_proj.weight", "layers.0.down_proj.weight"}  # not the head, not the norm


@pytest.mark.parametrize(
    ("scales", "said"),
    [
        ({"layers.0.q_proj.weight_scale_inv": (2, 1)}, r"weight_scale_inv has shape \[2, 1\], not the \[2, 2\]"),
        ({"layers.0.q_proj.weight_scale": (256, 2)}, r"weight_scale has shape \[256, 2\], neither one value"),
        (
            {"layers.0.q_proj.weight_scale": (256, 1), "layers.0.down_proj.weight_scale_inv": (2, 4)},
            r"more than one FP8 format \(\['block', 'per_channel'\]\)",
        ),
    ],
)
def test_a_quantization_ckpt_engine_cannot_make_is_refused(scales: dict[str, tuple[int, ...]], said: str) -> None:
    from ckpt_vllm.model.model_quantization import derive_weight_quantization

    with pytest.raises(RolloutLoadError, match=said):
        derive_weight_quantization(fp8_layout(scales), torch.bfloat16)


def test_a_model_without_scales_holds_nothing_quantized() -> None:
    from ckpt_vllm.model.model_quantization import derive_weight_quantization

    assert derive_weight_quantization(fp8_layout({}), torch.bfloat16) is None


# --- FP8 scales in a sharded layout -----------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "kept"),
    [
        (Fp8Format.PER_CHANNEL, slices((384, 256), 0, [(128, 64), (320, 64)])),  # rows: a fused part's
        (Fp8Format.PER_CHANNEL, slices((384, 256), 1, [(128, 128)])),  # columns: a row-parallel layer's
        (Fp8Format.PER_CHANNEL, nothing((384, 256))),
        (Fp8Format.PER_TENSOR, slices((384, 256), 0, [(0, 192)])),
        (Fp8Format.BLOCK, slices((384, 256), 0, [(128, 128), (256, 128)])),
        (Fp8Format.BLOCK, slices((300, 256), 0, [(256, 44)])),  # the last, partial block
        (Fp8Format.BLOCK, slices((384, 300), 1, [(128, 172)])),
        (Fp8Format.BLOCK, whole((384, 300))),
    ],
)
def test_a_rank_keeps_the_scales_of_what_it_keeps_of_their_weight(fmt: Fp8Format, kept: KeptWeight) -> None:
    """The scales a rank receives (the full weight quantized, then selected by
    ``scale_kept``) are the scales of the rows, columns or blocks it holds: those its part of
    the weight has, quantized on its own (a row's or a block's scale depends on it alone);
    the whole weight's scales where its part was quantized by them: a row-parallel rank's
    columns by their full rows' scales, any part by a per-tensor scale."""
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(kept.shape, generator=generator) * torch.logspace(-2, 1, kept.shape[0])[:, None]).bfloat16()
    name = "model.layers.0.self_attn.q_proj.weight"
    full = quantize(name, weight, fmt)
    recorded = (kept.shape[0] // 2, 1) if fmt is Fp8Format.PER_CHANNEL else (1,)  # what a rank records: unused
    selected = scale_kept(full.scale_name, recorded, kept).select(full.scale)
    part = kept.select(weight)
    if part is None or fmt is Fp8Format.PER_TENSOR or (fmt is Fp8Format.PER_CHANNEL and kept.dim == 1):
        expected = None if part is None else full.scale
    else:
        expected = quantize(name, part, fmt).scale
    if expected is None:
        assert selected is None
    else:
        assert selected is not None and torch.equal(selected, expected)


@pytest.mark.parametrize(
    "kept", [slices((384, 256), 0, [(64, 128)]), slices((384, 256), 1, [(0, 100)]), slices((384, 256), 0, [(0, 200)])]
)
def test_a_shard_that_cuts_a_block_of_fp8_scales_is_refused(kept: KeptWeight) -> None:
    with pytest.raises(
        WeightLayoutError, match=r"q_proj\.weight_scale_inv: this rank keeps elements .* cuts a 128x128"
    ):
        scale_kept("model.layers.0.self_attn.q_proj.weight_scale_inv", (1, 2), kept)


@pytest.mark.parametrize(
    ("client_url", "name", "version", "said"),
    [
        (None, "policy", "1", "send_adapter reaches the server over HTTP"),
        ("http://127.0.0.1:1", "", "1", "name and version must be non-empty strings"),
        ("http://127.0.0.1:1", "policy", "", "name and version must be non-empty strings"),
        ("http://127.0.0.1:1", "policy", "v@2", "the version without '@'"),
    ],
)
def test_an_adapter_send_with_bad_arguments_is_refused_before_anything_is_sent(
    client_url: str | None, name: str, version: str, said: str
) -> None:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerWeightTransferEngine

    client = HTTPVLLMWeightSyncClient(client_url) if client_url else object()
    trainer = CkptTrainerWeightTransferEngine(client=client)
    with pytest.raises(InvalidArgumentError, match=re.escape(said)):
        trainer.send_adapter(name, [], config={"r": 8}, version=version)


# --- an adapter against the model's layers -----------------------------------------------------

DOWN = "base_model.model.model.layers.0.mlp.down_proj"
LORA_CONFIG = {"r": 8, "lora_alpha": 16, "target_modules": ["down_proj"]}


class _SizedLayer(torch.nn.Module):
    """A layer sized as vLLM's LoRA-served layers say it (``input_size``, ``output_size``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.input_size = in_features
        self.output_size = out_features


def _one_layer_model(in_features: int, out_features: int) -> torch.nn.Module:
    """A model whose one LoRA-served layer is ``model.layers.0.mlp.down_proj``."""
    block = torch.nn.Module()
    block.mlp = torch.nn.Module()
    block.mlp.down_proj = _SizedLayer(in_features, out_features)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([block])
    return model


def _adapter(in_features: int, out_features: int) -> dict[str, torch.Tensor]:
    return {f"{DOWN}.lora_A.weight": torch.zeros(8, in_features), f"{DOWN}.lora_B.weight": torch.zeros(out_features, 8)}


def test_an_adapter_that_does_not_fit_its_layer_is_refused_also_once_the_layers_shape_is_remembered() -> None:
    from ckpt_vllm.errors import AdapterError
    from ckpt_vllm.model.lora import check_adapter

    model = _one_layer_model(64, 32)
    shapes: dict[str, tuple[int, int]] = {}
    check_adapter(_adapter(64, 32), LORA_CONFIG, model, {}, shapes)
    assert shapes == {DOWN: (64, 32)}
    said = "down_proj: lora_A [8, 32] and lora_B [64, 8] do not fit the model's layer (64 in, 32 out)"
    for remembered in (shapes, None):  # the remembered shape, and the layer looked up again
        with pytest.raises(AdapterError, match=re.escape(said)):
            check_adapter(_adapter(32, 64), LORA_CONFIG, model, {}, remembered)
    check_adapter(_adapter(64, 32), LORA_CONFIG, model, {}, shapes)


# --- init_info, as vLLM passes it on (a dict, from Python or JSON) -----------------------------

INIT_INFO = {"transport": "gloo_cpu", "bucket_size_bytes": 1 << 20, "rendezvous": "127.0.0.1:1"}


def test_init_infos_old_timeout_is_refused_naming_its_new_name_and_the_engines_own() -> None:
    """``timeout_s`` of an ``init_info`` bounded only the rendezvous, beside the engine's own
    ``timeout_s`` in ``engine_kwargs``: the old name is refused, saying both, never taken for
    either bound."""
    from ckpt_vllm.weight_transfer.worker_engine import CkptInitInfo

    with pytest.raises(InvalidArgumentError, match=r"'timeout_s' is now called 'rendezvous_timeout_s'.*engine_kwargs"):
        CkptInitInfo.from_dict({**INIT_INFO, "timeout_s": 5})
    info = CkptInitInfo.from_dict({**INIT_INFO, "rendezvous_timeout_s": 5})
    info.check()
    assert info.rendezvous_timeout_s == 5
    with pytest.raises(InvalidArgumentError, match=r"rendezvous_timeout_s must be"):
        CkptInitInfo.from_dict({**INIT_INFO, "rendezvous_timeout_s": 0}).check()
    with pytest.raises(InvalidArgumentError, match=r"no field \['timeout'\] \(its fields: \['transport'"):
        CkptInitInfo.from_dict({**INIT_INFO, "timeout": 5})


def test_a_workers_prepare_refuses_the_old_timeout_in_its_reply() -> None:
    """``ckpt_engine_prepare`` (a driver's call before init) parses ``init_info`` as vLLM's
    init does: the old name comes back as the rank's error, before any engine is built."""
    from ckpt_vllm.weight_transfer.extension import CkptEngineWorkerExtension
    from ckpt_vllm.weight_transfer.worker_engine import CkptWeightTransferEngine

    worker = CkptEngineWorkerExtension()
    # No vLLM worker behind it: the init_info is refused before the engine is used.
    worker.weight_transfer_engine = CkptWeightTransferEngine.__new__(CkptWeightTransferEngine)
    reply = worker.ckpt_engine_prepare(init_info={**INIT_INFO, "timeout_s": 5})
    assert not reply["ok"] and reply["error_type"] == "InvalidArgumentError", reply
    assert "rendezvous_timeout_s" in reply["message"] and "engine_kwargs" in reply["message"], reply


# --- the package's layout ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kept", "home", "names"),
    [
        (
            "ckpt_vllm.transfer",
            "ckpt_vllm.weight_transfer.worker_engine",
            ["CkptInitInfo", "CkptUpdateInfo", "CkptWeightTransferEngine", "settle"],
        ),
        (
            "ckpt_vllm.trainer",
            "ckpt_vllm.weight_transfer.trainer_engine",
            ["CkptTrainerInitInfo", "CkptTrainerWeightTransferEngine", "Weights"],
        ),
        ("ckpt_vllm.extension", "ckpt_vllm.weight_transfer.extension", ["CkptEngineWorkerExtension"]),
        (
            "ckpt_vllm.serve",
            "ckpt_vllm.devtools.serve",
            ["STOP_GRACE_S", "free_port", "local_vllm_serve", "serve_command"],
        ),
    ],
)
def test_the_flat_layouts_import_paths_name_the_same_objects(kept: str, home: str, names: list[str]) -> None:
    old, new = importlib.import_module(kept), importlib.import_module(home)
    assert sorted(old.__all__) == sorted(names)
    for name in names:
        assert getattr(old, name) is getattr(new, name), name


def test_the_entry_point_and_the_worker_extension_resolve() -> None:
    """What vLLM resolves by name: the ``vllm.general_plugins`` entry point of the installed
    distribution, and :data:`ckpt_vllm.WORKER_EXTENSION`."""
    from importlib.metadata import entry_points

    from ckpt_vllm import WORKER_EXTENSION
    from ckpt_vllm.plugin import register
    from ckpt_vllm.weight_transfer.extension import CkptEngineWorkerExtension

    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ckpt_engine"]
    assert entry.load() is register
    module, _, name = WORKER_EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is CkptEngineWorkerExtension


# --- the trainer's side against vLLM 0.33's own base classes (0.32's installed) ----------------


def test_vllm_033s_own_module_source_gives_the_trainer_the_same_bytes_as_032s(vllm_next_base: Any) -> None:
    from vllm.distributed.weight_transfer.base import ModuleSource

    from ckpt_vllm.weight_transfer.trainer_engine import source_weights

    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)

    def pairs(source: Any) -> list[tuple[str, bytes]]:
        return [(name, t.contiguous().view(torch.uint8).numpy().tobytes()) for name, t in source_weights(source)]

    next_source = vllm_next_base.ModuleSource(module)
    assert not hasattr(type(next_source), "__iter__"), "0.33's source is not iterable: the trainer must call iter_full"
    assert pairs(next_source) == pairs(ModuleSource(module)) != []
    assert pairs(ModuleSource(module)) == pairs(ModuleSource(module)), "every call is a fresh pass"
    with pytest.raises(InvalidArgumentError, match="iter_full\\(\\) in vLLM 0.33, iterable in 0.32"):
        source_weights(object())


def test_the_trainer_engine_meets_vllm_033s_trainer_side_contract(vllm_next_base: Any) -> None:
    """What vLLM 0.33's factory and RL tooling call on a trainer engine and its init info: no
    abstract method of 0.33's ``TrainerWeightTransferEngine`` left unimplemented, ``trainer_init``
    taking ``(init_info, *, client, source)``, ``send_weights()`` taking no argument (it replays
    the source), and every field of 0.33's ``TrainerInitInfo`` (``rank``, keyword-only)."""
    import dataclasses
    import inspect

    from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo, CkptTrainerWeightTransferEngine

    class OnNextBase(CkptTrainerWeightTransferEngine, vllm_next_base.TrainerWeightTransferEngine):  # type: ignore[misc]
        pass

    assert not OnNextBase.__abstractmethods__
    info = CkptTrainerInitInfo(rank=0, transport="gloo_cpu", bucket_size_bytes=1 << 20)
    inspect.signature(OnNextBase.trainer_init).bind(info, client=object(), source=None)
    inspect.signature(OnNextBase.send_weights).bind(OnNextBase(client=object()))
    fields = {field.name: field for field in dataclasses.fields(CkptTrainerInitInfo)}
    for field in dataclasses.fields(vllm_next_base.TrainerInitInfo):
        assert field.name in fields and fields[field.name].kw_only == field.kw_only, field.name
    assert CkptTrainerInitInfo.backend and info.is_sender
