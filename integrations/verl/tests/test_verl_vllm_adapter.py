"""``CkptVllmServerAdapter`` before it reaches a server: what it takes from verl's rollout
config, what it refuses, how it travels to a worker, and how it waits on what a checkpoint
engine receives. Landing weights in vLLM through verl's manager is
``integrations/vllm/tests/test_vllm_ray.py::test_verls_manager_lands_its_syncs_in_this_engine``."""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import AsyncGenerator
from typing import Any

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (the dev set-up pins verl==0.9.1)")
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402

from ckpt_core.errors import InvalidArgumentError, TransferTimeoutError  # noqa: E402
from ckpt_verl.vllm_adapter import CkptVllmServerAdapter, _blocking  # noqa: E402


class UnreachableClient:
    """A weight-sync client for an adapter that must refuse before it connects."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the adapter called the server ({name}) before refusing")


def adapter(**kwargs: Any) -> CkptVllmServerAdapter:
    config = RolloutConfig(
        name="vllm",
        checkpoint_engine=CheckpointEngineConfig(backend="ckpt_gloo_cpu", update_weights_bucket_megabytes=8),
        tensor_model_parallel_size=2,
        data_parallel_size=3,
    )
    return CkptVllmServerAdapter(config, client=UnreachableClient(), transport="gloo_cpu", **kwargs)


class Received:
    """What a checkpoint engine's ``receive_weights`` hands an adapter: an async generator,
    here of two tensors, that notes whether it was closed before its end."""

    def __init__(self) -> None:
        self.closed_early = False

    async def weights(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        try:
            for index in range(2):
                yield f"w{index}", torch.full((4,), float(index))
        except GeneratorExit:
            self.closed_early = True
            raise


def test_the_server_size_and_bucket_come_from_verls_rollout_config() -> None:
    plain = adapter()
    assert plain.rollout_world_size == 6  # tensor 2 x pipeline 1 x data 3
    assert plain.bucket_size_bytes == 8 << 20
    assert adapter(rollout_world_size=2).rollout_world_size == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"wire_format": "delta_flush"}, "wire_format='named_tensors'"),
        ({"peft_config": {"r": 8}}, "send_adapter"),
    ],
    ids=["delta-flush", "lora"],
)
def test_what_it_cannot_install_is_refused_and_the_receive_ends_at_once(kwargs: dict[str, Any], match: str) -> None:
    received = Received()

    async def sync() -> bool:
        weights = received.weights()
        await weights.__anext__()  # a receive under way, as the worker hands it over
        with pytest.raises(InvalidArgumentError, match=match):
            await adapter().update_weights(weights, global_steps=3, **kwargs)
        return received.closed_early  # before asyncio.run closes what is left open

    assert asyncio.run(sync()), "the checkpoint engine's receive was left to run out its deadline"


def test_a_connected_adapter_travels_as_its_settings() -> None:
    original = adapter(engine_kwargs={"timeout_s": 30.0})
    original._trainer = object()  # what a first sync leaves: an engine bound to this process
    copy = pickle.loads(pickle.dumps(original))
    assert copy._trainer is None and original._trainer is not None
    assert (copy.transport, copy.engine_kwargs, copy.rollout_world_size) == ("gloo_cpu", {"timeout_s": 30.0}, 6)


def test_received_tensors_are_waited_for_within_timeout_s() -> None:
    """The refit's thread takes the received pairs one by one from the adapter's loop; a
    receive that stalls is a ``TransferTimeoutError`` after ``timeout_s``, not a hang."""

    async def stalls() -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        yield "w0", torch.zeros(2)
        await asyncio.sleep(60)
        yield "w1", torch.zeros(2)

    async def take(source: Any) -> tuple[list[str], BaseException | None, float]:
        pairs = _blocking(source, asyncio.get_running_loop(), 0.3)
        names: list[str] = []

        def drain() -> None:
            for name, _ in pairs:
                names.append(name)

        start = time.monotonic()
        try:
            await asyncio.to_thread(drain)
        except BaseException as exc:  # noqa: BLE001 - the test's to check
            return names, exc, time.monotonic() - start
        return names, None, time.monotonic() - start

    names, error, took = asyncio.run(take(Received().weights()))
    assert names == ["w0", "w1"] and error is None
    names, error, took = asyncio.run(take(stalls()))
    assert names == ["w0"] and isinstance(error, TransferTimeoutError), error
    assert 0.3 <= took < 5.0, took
