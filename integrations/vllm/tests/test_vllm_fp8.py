"""Quantize-on-send into an FP8 vLLM (the CPU build): a compressed-tensors FP8 checkpoint with
per-channel scales served by vLLM, refitted by a BF16 trainer whose engine quantizes each
weight the workers' ``weight_quantization`` names (``quantize_for_rollout``), the workers
having derived it from their live model.

Three refits in a row, each token-equal to vLLM quantizing the same trainer weights itself:
its online ``fp8_per_channel`` of W1 at start-up, then its own reload of W2 and W3. The
refitted engine starts from an FP8 checkpoint of the start-up model, so the first refit
changes every weight. At tensor-parallel size 2, sharded: each worker receives its shards of
the FP8 weights and their scales, token-equal to the same engine loading W1..W3 quantized by
vLLM's per-channel quantizer. And the way without quantize-on-send: BF16 refits of the online
engine, which quantizes on load, token-equal to its own reloads (the engine that made the
references).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REFITS, greedy_tokens, tokens_then_reloads, trainer_pool, vllm_engine
from test_fp8_reference import vllm_per_channel
from test_vllm_refit import CALL_TIMEOUT_S, in_parallel, train

from ckpt_core.orchestration.rendezvous import MetadataRendezvous
from ckpt_vllm.model.model_quantization import save_fp8_checkpoint

BUCKET = 1 << 20
BACKENDS: dict[str, dict[str, Any]] = {"gloo_cpu": {}, "cuda_ipc": {"device": "cpu"}}


def three_refits(
    llm: Any, backend: str, engine_kwargs: dict[str, Any], checkpoints: dict[str, Any], tp: int = 1
) -> list[Any]:
    """A trainer replaying W1..W3 refits ``llm`` (``tp`` workers) after each step through
    vLLM's offline calls (meeting its workers at a rendezvous); the greedy tokens after each
    refit."""
    init_info = {"transport": backend, "bucket_size_bytes": BUCKET, "engine_kwargs": engine_kwargs}
    tokens = []
    try:
        with trainer_pool(checkpoints["start"], backend, **engine_kwargs) as trainer:
            with MetadataRendezvous() as rendezvous:
                (joined,), _ = in_parallel(
                    lambda: trainer.call(
                        [(0, "connect", {"rendezvous": rendezvous.address, "rollout_world_size": tp})], CALL_TIMEOUT_S
                    ),
                    lambda: llm.init_weight_transfer_engine(
                        {"init_info": {**init_info, "rendezvous": rendezvous.address}}
                    ),
                )
                assert joined.ok, joined.describe()
            for k in range(REFITS):
                train(trainer)
                llm.start_weight_update()
                (sent,), _ = in_parallel(
                    lambda: trainer.call([(0, "refit", {})], CALL_TIMEOUT_S),
                    lambda: llm.update_weights({"update_info": {}}),
                )
                assert sent.ok, sent.describe()
                llm.finish_weight_update(weight_version=f"{backend}-{k + 1}")
                assert llm.reset_prefix_cache()
                tokens.append(greedy_tokens(llm.generate))
    finally:
        llm.shutdown_weight_transfer_engine()
    return tokens


class TestTensorParallel1:
    """One worker, which receives every FP8 weight and its scales whole. The class's engines
    run in this process one at a time (see conftest.vllm_engine): first one quantizing online
    (``fp8_per_channel`` over the BF16 checkpoints), whose tokens are the references and which
    the BF16 refits go into; then one served from an FP8 checkpoint of the start-up model, for
    the quantizing refits."""

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls) -> Iterator[OneEngineAtATime]:
        with OneEngineAtATime() as engines:
            yield engines

    @pytest.fixture(scope="class")
    @classmethod
    def references(cls, engines: OneEngineAtATime, checkpoints: dict[str, Any]) -> list[list[list[int]]]:
        """What the online engine generates from W1 at start-up and from W2 and W3 after its
        own reload (it is left at W3)."""
        first, *later = checkpoints["weights"]
        return tokens_then_reloads(engines.start("online", first, quantization="fp8_per_channel"), later)

    def test_bf16_refits_into_an_engine_that_quantizes_on_load(
        self, engines: OneEngineAtATime, references: list[list[list[int]]], checkpoints: dict[str, Any]
    ) -> None:
        """Without quantize-on-send: BF16 into the engine quantizing online, which quantizes
        each layer as it reloads it (its scales are made there, not sent: the refit is
        complete without them)."""
        llm = engines.start("online", checkpoints["weights"][0], quantization="fp8_per_channel")
        assert three_refits(llm, "gloo_cpu", {}, checkpoints) == references

    @pytest.mark.parametrize("backend", sorted(BACKENDS))
    def test_three_quantizing_refits_equal_vllms_own_fp8(
        self,
        backend: str,
        engines: OneEngineAtATime,
        references: list[list[list[int]]],
        checkpoints: dict[str, Any],
        tmp_path_factory: pytest.TempPathFactory,
    ) -> None:
        """Quantize-on-send into the engine served from an FP8 checkpoint of the start-up
        model: the first refit changes every weight."""
        if engines.kind != "fp8":
            start = save_fp8_checkpoint(checkpoints["start"], tmp_path_factory.mktemp("fp8") / "start")
            engines.start("fp8", start)
        engine_kwargs = {**BACKENDS[backend], "quantize_for_rollout": True}
        assert three_refits(engines.llm, backend, engine_kwargs, checkpoints) == references


class OneEngineAtATime(contextlib.ExitStack):
    """In-process engines (``vllm_engine`` at size 1, selecting the ckpt backend) of which one
    runs at a time: starting another kind ends the running one; exit ends the last."""

    kind: str | None = None
    llm: Any = None

    def start(self, kind: str, model: Path, **extra: Any) -> Any:
        """The running engine if it is of ``kind``; else ``model`` in a new one."""
        if kind != self.kind:
            self.close()
            self.kind, self.llm = None, None
            self.llm = self.enter_context(vllm_engine(model, 1, weight_transfer_config={"backend": "ckpt"}, **extra))
            self.kind = kind
        return self.llm


def vllm_quantized_checkpoint(source: Path, target: Path) -> Path:
    """``source`` as a compressed-tensors FP8 checkpoint (:func:`save_fp8_checkpoint`'s
    format) whose bytes and scales vLLM's own per-channel quantizer made."""
    from safetensors.torch import load_file, save_file

    save_fp8_checkpoint(source, target)
    full = {name: t for file in source.glob("*.safetensors") for name, t in load_file(str(file)).items()}
    file = target / "model.safetensors"
    tensors = load_file(str(file))
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        weight = name.removesuffix("_scale")
        tensors[weight], scale = vllm_per_channel(full[weight])
        tensors[name] = scale.to(torch.float32).reshape(tensors[name].shape)
    save_file(tensors, str(file))
    return target


class TestShardedAtTensorParallel2:
    """Each of two tensor-parallel workers receives only its shards of the FP8 weights and the
    scales of its rows (``shard_expert_weights``, topology fanout). The references are one
    TP 2 engine's own: what it generates from W1 quantized by vLLM's per-channel quantizer (a
    fresh engine), then after its reload of W2 and W3 quantized so; it is left at W3 and then
    refitted."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_and_references(
        cls, checkpoints: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[tuple[Any, list[list[list[int]]]]]:
        root = tmp_path_factory.mktemp("fp8_tp2")
        first, *later = [vllm_quantized_checkpoint(w, root / w.name) for w in checkpoints["weights"]]
        with vllm_engine(first, 2, weight_transfer_config={"backend": "ckpt"}) as llm:
            yield llm, tokens_then_reloads(llm, later)

    @pytest.mark.parametrize("backend", sorted(BACKENDS))
    def test_three_sharded_quantizing_refits_equal_vllms_own_fp8(
        self, backend: str, engine_and_references: tuple[Any, list[list[list[int]]]], checkpoints: dict[str, Any]
    ) -> None:
        llm, references = engine_and_references
        engine_kwargs = {
            **BACKENDS[backend],
            "quantize_for_rollout": True,
            "shard_expert_weights": True,
            "topology": "fanout",
        }
        assert three_refits(llm, backend, engine_kwargs, checkpoints, tp=2) == references
