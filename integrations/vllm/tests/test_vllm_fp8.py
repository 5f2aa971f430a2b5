"""Quantize-on-send into an FP8 vLLM (the CPU build): a compressed-tensors FP8 checkpoint with
per-channel scales served by vLLM, refitted by a BF16 trainer whose engine quantizes each
weight the workers' ``weight_quantization`` names (``quantize_for_rollout``), the workers
having derived it from their live model.

Three refits in a row, each token-equal to vLLM quantizing the same trainer weights itself:
its online ``fp8_per_channel`` of W1 at start-up, then its own reload of W2 and W3. The
refitted engine starts from an FP8 checkpoint of the start-up model, so the first refit
changes every weight. And the way without quantize-on-send: BF16 refits of that online
engine, which quantizes on load, token-equal to its own reloads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import REFITS, greedy_tokens, tokens_then_reloads, trainer_pool, vllm_engine
from test_vllm_refit import CALL_TIMEOUT_S, in_parallel, train

from ckpt_core.orchestration.rendezvous import MetadataRendezvous
from ckpt_vllm.quantization import save_fp8_checkpoint

BUCKET = 1 << 20
BACKENDS: dict[str, dict[str, Any]] = {"gloo_cpu": {}, "cuda_ipc": {"device": "cpu"}}


@pytest.fixture(scope="module")
def online_fp8(checkpoints: dict[str, Any]) -> Iterator[tuple[Any, list[list[list[int]]]]]:
    """An engine quantizing online (``fp8_per_channel`` over BF16 checkpoints), and what it
    generates from W1 at start-up and from W2 and W3 after its own reload: the tokens every
    refit into an FP8 engine must reproduce. It is left at W3."""
    first, *later = checkpoints["weights"]
    with vllm_engine(first, 1, quantization="fp8_per_channel", weight_transfer_config={"backend": "ckpt"}) as llm:
        yield llm, tokens_then_reloads(llm, later)


@pytest.fixture(scope="module")
def fp8_references(online_fp8: tuple[Any, list[list[list[int]]]]) -> list[list[list[int]]]:
    return online_fp8[1]


@pytest.fixture(scope="module")
def fp8_llm(checkpoints: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An engine served from an FP8 checkpoint of the start-up model."""
    start = save_fp8_checkpoint(checkpoints["start"], tmp_path_factory.mktemp("fp8") / "start")
    with vllm_engine(start, 1, weight_transfer_config={"backend": "ckpt"}) as llm:
        yield llm


def three_refits(llm: Any, backend: str, engine_kwargs: dict[str, Any], checkpoints: dict[str, Any]) -> list[Any]:
    """A trainer replaying W1..W3 refits ``llm`` after each step through vLLM's offline calls
    (meeting its workers at a rendezvous); the greedy tokens after each refit."""
    init_info = {"transport": backend, "bucket_size_bytes": BUCKET, "engine_kwargs": engine_kwargs}
    tokens = []
    try:
        with trainer_pool(checkpoints["start"], backend, **engine_kwargs) as trainer:
            with MetadataRendezvous() as rendezvous:
                (joined,), _ = in_parallel(
                    lambda: trainer.call(
                        [(0, "connect", {"rendezvous": rendezvous.address, "rollout_world_size": 1})], CALL_TIMEOUT_S
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


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_three_quantizing_refits_equal_vllms_own_fp8(
    backend: str, fp8_llm: Any, fp8_references: list[list[list[int]]], checkpoints: dict[str, Any]
) -> None:
    engine_kwargs = {**BACKENDS[backend], "quantize_for_rollout": True}
    assert three_refits(fp8_llm, backend, engine_kwargs, checkpoints) == fp8_references


def test_bf16_refits_into_an_engine_that_quantizes_on_load(
    online_fp8: tuple[Any, list[list[list[int]]]], checkpoints: dict[str, Any]
) -> None:
    """Without quantize-on-send: BF16 into the online engine, which quantizes each layer as it
    reloads it (its scales are made there, not sent: the refit is complete without them)."""
    llm, references = online_fp8
    assert three_refits(llm, "gloo_cpu", {}, checkpoints) == references
