"""LoRA adapters refitted into vLLM and served from memory (ckpt_vllm.model.lora): a trainer trains
an adapter (PEFT's LoRA and names) on the tiny Qwen2 and refits only the adapter after each
step; the engine serves it with no file written. After each refit the adapter's greedy tokens
equal those of the same adapter saved to disk and loaded by vLLM itself (under another id),
and the tokens without an adapter do not change; a full refit of the model's weights keeps the
adapter serving; a bad adapter is refused by name while its previous version serves on."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import LORA_ENGINE, greedy_tokens, trainer_pool, vllm_engine
from test_vllm_refit import CALL_TIMEOUT_S, in_parallel, refit, set_up, train

from ckpt_core.errors import LifecycleError
from ckpt_core.orchestration.coordinator import RefitFailedError
from ckpt_vllm import VLLM_ENGINE_ARGS, VllmRollout

BUCKET = 1 << 20


def with_adapter(llm: Any, request: Any) -> list[list[int]]:
    return greedy_tokens(functools.partial(llm.generate, lora_request=request))


def refit_adapter(
    trainer: Any, rollout: VllmRollout, config: dict[str, Any], name: str = "policy", lora_id: int = 1, **faults: Any
) -> Any:
    """The trainer sends its adapter while every rank receives it as adapter ``name``; the
    rollout's reports, or its error."""

    def receive() -> Any:
        try:
            return rollout.refit_adapter(name, lora_id=lora_id, config=config)
        except RefitFailedError as exc:
            return exc

    (sent,), received = in_parallel(lambda: trainer.call([(0, "refit_lora", faults)], CALL_TIMEOUT_S), receive)
    assert sent.ok, sent.describe()
    return received


def three_adapter_refits_then_a_full_one(
    llm: Any, checkpoints: dict[str, Any], tmp_path: Path, backend: str, options: dict[str, Any]
) -> None:
    """Three training steps of an adapter, each refitted as "policy" and checked against the
    same adapter saved and loaded by vLLM; then a full refit of the model's weights (vLLM
    removes every adapter when it ends), after which the adapter serves on, over the new
    weights, as vLLM serves it from disk over them."""
    from vllm.lora.request import LoRARequest

    rollout = VllmRollout(llm, backend=backend, bucket_size_bytes=BUCKET, engine_kwargs=options)
    base = greedy_tokens(llm.generate)
    try:
        with trainer_pool(checkpoints["start"], backend, **options) as trainer:
            (added,) = trainer.call([(0, "add_lora", {})], CALL_TIMEOUT_S)
            assert added.ok, added.describe()
            config = added.value
            set_up(trainer, rollout)
            seen = []
            for step in range(1, 4):
                (trained,) = trainer.call([(0, "train", {"steps": 1})], CALL_TIMEOUT_S)
                assert trained.ok, trained.describe()
                reports = refit_adapter(trainer, rollout, config)
                assert not isinstance(reports, Exception), reports
                assert all(r["version"] == str(step) and r["tensors"] == 8 for r in reports), reports
                assert all(min(r["seconds"].values()) > 0 for r in reports), reports  # received, held, installed
                assert all(r["ended_at"] - r["started_at"] >= sum(r["seconds"].values()) for r in reports), reports
                from_memory = with_adapter(llm, rollout.lora_request("policy"))
                (saved,) = trainer.call([(0, "save_lora", {"path": str(tmp_path / f"v{step}")})], CALL_TIMEOUT_S)
                assert saved.ok, saved.describe()
                from_disk = with_adapter(llm, LoRARequest(f"disk-{step}", 10 + step, str(tmp_path / f"v{step}")))
                assert from_memory == from_disk, f"step {step}: the adapter served from memory differs"
                assert greedy_tokens(llm.generate) == base, f"step {step}: tokens without the adapter changed"
                seen.append(from_memory)
                llm.llm_engine.remove_lora(10 + step)
            assert len({str(tokens) for tokens in [base, *seen]}) == 4, "a step did not change the tokens"
            for status in rollout.status():
                assert status["adapters"]["policy"]["version"] == "3", status
        with trainer_pool(checkpoints["start"], backend, **options) as full:
            set_up(full, rollout)
            train(full)
            sent, reports = refit(full, rollout)
            assert sent.ok and not isinstance(reports, Exception), reports
            after = with_adapter(llm, rollout.lora_request("policy"))
            assert after == with_adapter(llm, LoRARequest("disk-after", 20, str(tmp_path / "v3")))
            assert after != seen[-1], "the full refit did not change the adapter's tokens"
    finally:
        rollout.finalize()


LAYER0 = "base_model.model.model.layers.0"
BAD_ADAPTERS: dict[str, tuple[dict[str, Any], str]] = {
    "a module the model lacks": (
        {
            "extra": {
                f"{LAYER0.replace('layers.0', 'layers.7')}.self_attn.q_proj.lora_A.weight": [8, 256],
                f"{LAYER0.replace('layers.0', 'layers.7')}.self_attn.q_proj.lora_B.weight": [256, 8],
            }
        },
        "layers.7.self_attn.q_proj: the adapter targets a module this model does not have",
    ),
    "another rank": (
        {
            "extra": {
                f"{LAYER0}.self_attn.k_proj.lora_A.weight": [4, 256],
                f"{LAYER0}.self_attn.k_proj.lora_B.weight": [128, 4],
            }
        },
        "k_proj: lora_A [4, 256] and lora_B [128, 4] are not of rank 8",
    ),
    "a shape the layer does not have": (
        {
            "extra": {
                f"{LAYER0}.self_attn.k_proj.lora_A.weight": [8, 128],
                f"{LAYER0}.self_attn.k_proj.lora_B.weight": [128, 8],
            }
        },
        "k_proj: lora_A [8, 128] and lora_B [128, 8] do not fit the model's layer (256 in, 128 out)",
    ),
    "a missing tensor": (
        {"skip": f"{LAYER0}.self_attn.v_proj.lora_B.weight"},
        "layers.0.self_attn.v_proj: the adapter has no lora_B.weight for it",
    ),
    "a weight that is not LoRA's": (
        {"extra": {"base_model.model.model.norm.weight": [256]}},
        "model.norm.weight: not a LoRA weight",
    ),
}


class TestTensorParallel1:
    """One engine, in this process (see conftest.vllm_engine), for the class's tests."""

    @pytest.fixture(scope="class")
    @classmethod
    def lora_llm(cls, checkpoints: dict[str, Any]) -> Iterator[Any]:
        with vllm_engine(checkpoints["start"], 1, **VLLM_ENGINE_ARGS, **LORA_ENGINE) as llm:
            yield llm

    def test_adapter_refits_serve_from_memory_what_vllm_serves_from_disk(
        self, lora_llm: Any, checkpoints: dict[str, Any], tmp_path: Path
    ) -> None:
        three_adapter_refits_then_a_full_one(lora_llm, checkpoints, tmp_path, "gloo_cpu", {})

    def test_a_bad_adapter_is_refused_by_name_and_the_previous_version_keeps_serving(
        self, lora_llm: Any, checkpoints: dict[str, Any]
    ) -> None:
        rollout = VllmRollout(lora_llm, backend="gloo_cpu", bucket_size_bytes=BUCKET)
        try:
            with trainer_pool(checkpoints["start"], "gloo_cpu") as trainer:
                (added,) = trainer.call([(0, "add_lora", {})], CALL_TIMEOUT_S)
                config = added.value
                set_up(trainer, rollout)
                (trained,) = trainer.call([(0, "train", {"steps": 1})], CALL_TIMEOUT_S)
                assert trained.ok, trained.describe()
                assert not isinstance(refit_adapter(trainer, rollout, config), Exception)
                good = with_adapter(lora_llm, rollout.lora_request("policy"))
                for case, (faults, said) in BAD_ADAPTERS.items():
                    (trained,) = trainer.call([(0, "train", {"steps": 1})], CALL_TIMEOUT_S)
                    error = refit_adapter(trainer, rollout, config, **faults)
                    assert isinstance(error, RefitFailedError), f"{case}: {error}"
                    failure = error.failures[0]
                    assert failure.error_type == "AdapterError" and said in (failure.message or ""), (case, failure)
                    assert with_adapter(lora_llm, rollout.lora_request("policy")) == good, (
                        f"{case}: the old version changed"
                    )
                over = {"r": 64, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}  # not the tensors rank
                error = refit_adapter(trainer, rollout, over)
                assert isinstance(error, RefitFailedError) and "AdapterError" == error.failures[0].error_type, error
                assert with_adapter(lora_llm, rollout.lora_request("policy")) == good
                rollout.remove_adapter("policy")
        finally:
            rollout.finalize()

    def test_two_adapters_serve_side_by_side_and_refit_independently(
        self, lora_llm: Any, checkpoints: dict[str, Any], tmp_path: Path
    ) -> None:
        """Adapters "early" (after one step) and "late" (after two) are served at once; refitting
        "early" again (after three steps) leaves "late" as it was. Each equals its version loaded
        from disk by vLLM."""
        from vllm.lora.request import LoRARequest

        rollout = VllmRollout(lora_llm, backend="gloo_cpu", bucket_size_bytes=BUCKET)
        try:
            with trainer_pool(checkpoints["start"], "gloo_cpu") as trainer:
                (added,) = trainer.call([(0, "add_lora", {"seed": 2})], CALL_TIMEOUT_S)
                config = added.value
                set_up(trainer, rollout)

                def step_and_refit(name: str, lora_id: int, saved: str) -> None:
                    (trained,) = trainer.call([(0, "train", {"steps": 1})], CALL_TIMEOUT_S)
                    assert trained.ok, trained.describe()
                    assert not isinstance(refit_adapter(trainer, rollout, config, name, lora_id), Exception)
                    (done,) = trainer.call([(0, "save_lora", {"path": str(tmp_path / saved)})], CALL_TIMEOUT_S)
                    assert done.ok, done.describe()

                step_and_refit("early", 3, "one")
                step_and_refit("late", 4, "two")
                late = with_adapter(lora_llm, rollout.lora_request("late"))
                assert late == with_adapter(lora_llm, LoRARequest("disk-two", 12, str(tmp_path / "two")))
                step_and_refit("early", 3, "three")
                early = with_adapter(lora_llm, rollout.lora_request("early"))
                assert early == with_adapter(lora_llm, LoRARequest("disk-three", 13, str(tmp_path / "three")))
                assert with_adapter(lora_llm, rollout.lora_request("late")) == late, "refitting early changed late"
                assert early != late
                adapters = rollout.status()[0]["adapters"]
                assert {name: a["version"] for name, a in adapters.items()} == {"early": "3", "late": "2"}, adapters
                rollout.remove_adapter("early")
                with pytest.raises(LifecycleError, match="'early' is not served by every rank"):
                    rollout.lora_request("early")
                assert set(rollout.status()[0]["adapters"]) == {"late"}
                rollout.remove_adapter("late")
        finally:
            rollout.finalize()
