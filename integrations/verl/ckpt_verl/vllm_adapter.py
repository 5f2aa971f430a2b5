"""``CkptVllmServerAdapter``: verl's rollout server adapter for a vLLM server that runs
ckpt-vllm's weight-transfer backend (``--weight-transfer-config '{"backend": "ckpt"}'``).

In verl, a rollout replica's ``CheckpointEngineWorker`` receives each sync from the trainer
through its checkpoint engine and hands the ``(name, tensor)`` pairs to its server adapter's
``update_weights``; verl's own vLLM adapter passes them on to vLLM's workers over CUDA IPC (or
shared memory) through verl's worker extension. This adapter passes them on through ckpt-vllm
instead: it is the trainer side of vLLM's weight-transfer API
(:class:`ckpt_vllm.weight_transfer.trainer_engine.CkptTrainerWeightTransferEngine`), so the
server is a stock ``vllm serve`` (or an ``LLM``) with ckpt-vllm installed, any ckpt-core
transport carries this hop (``cuda_ipc`` on the GPU the two share, ``gloo_cpu`` or
``cuda_ipc`` with ``device="cpu"`` on a host), and vLLM's layerwise reload installs the
weights, whatever its quantization or layout.

Give it to ``CheckpointEngineWorker`` as its ``server_adapter`` (verl builds its own only when
none is given)::

    adapter = CkptVllmServerAdapter(rollout_config, client=HTTPVLLMWeightSyncClient(url),
                                    transport="gloo_cpu")
    RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker), rollout_config=rollout_config,
                         model_config=model_config, server_adapter=adapter)

The adapter is built where the replica is set up and shipped to the worker's process, so it
holds only its settings until its first ``update_weights``, which connects (vLLM's
``init_weight_transfer_engine`` beside this side's rendezvous). Each call is one refit, tagged
with verl's ``global_steps`` as the server's weight version; a failed one leaves no engine
behind, and the next call connects again (the server's workers rebuild theirs too).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import torch
from verl.workers.rollout.base import BaseRollout

from ckpt_core.errors import InvalidArgumentError, TransferTimeoutError
from ckpt_core.options import MAX_TIMEOUT_S, check_positive_number

__all__ = ["CkptVllmServerAdapter"]

Pair = tuple[str, torch.Tensor]


class CkptVllmServerAdapter(BaseRollout):
    """Forwards each sync a verl ``CheckpointEngineWorker`` receives into one vLLM server
    (module docstring).

    ``config`` is the replica's ``RolloutConfig``: its ``checkpoint_engine``'s bucket size sizes
    this hop too, and the server's worker count defaults to its tensor x pipeline x data
    parallel sizes (``rollout_world_size`` overrides it). ``client`` is the vLLM weight-sync
    client that reaches the server (``HTTPVLLMWeightSyncClient(url)``, or
    ``RayVLLMWeightSyncClient(handle)`` for an ``LLM`` actor); it travels with the adapter, so
    it must pickle. ``transport`` and ``engine_kwargs`` select and configure the ckpt-core
    engine of this hop (the server's workers get the same; ``server_engine_kwargs`` replaces
    them there, as ``CkptTrainerInitInfo.rollout_engine_kwargs`` does). ``timeout_s`` bounds the
    rendezvous, each call to the server, and each wait for the next received tensor.
    """

    def __init__(
        self,
        config: Any,
        model_config: Any = None,
        device_mesh: Any = None,
        *,
        client: Any,
        transport: str,
        engine_kwargs: dict[str, Any] | None = None,
        server_engine_kwargs: dict[str, Any] | None = None,
        rollout_world_size: int | None = None,
        replica_rank: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        check_positive_number(type(self).__name__, "timeout_s", timeout_s, MAX_TIMEOUT_S)
        parallel = self.config.tensor_model_parallel_size * self.config.pipeline_model_parallel_size
        self.rollout_world_size = rollout_world_size or parallel * self.config.data_parallel_size
        self.bucket_size_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        self.client = client
        self.transport = transport
        self.engine_kwargs = dict(engine_kwargs or {})
        self.server_engine_kwargs = None if server_engine_kwargs is None else dict(server_engine_kwargs)
        self.replica_rank = replica_rank
        self.is_leader_rank = True  # one adapter per server: it alone drives the server's calls
        self.timeout_s = float(timeout_s)
        self._trainer: Any = None  # the connected CkptTrainerWeightTransferEngine, from the first sync on

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: a connected engine stays in the process that connected it."""
        return {**self.__dict__, "_trainer": None}

    async def update_weights(
        self,
        weights: Iterable[Pair] | AsyncIterator[Pair],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        """One refit of the server with ``weights`` (a checkpoint engine's ``receive_weights``,
        or any iterable of pairs), its weight version ``str(global_steps)`` (``None``: the
        server's own count). Returns when the server serves them; raises the refit's error
        otherwise, the server keeping its previous weights."""
        try:
            if wire_format != "named_tensors":
                raise InvalidArgumentError(
                    f"{type(self).__name__} takes wire_format='named_tensors' (full tensors), got {wire_format!r}: "
                    "select a checkpoint engine that sends whole tensors"
                )
            if kwargs.get("peft_config") is not None:
                raise InvalidArgumentError(
                    f"{type(self).__name__}: LoRA adapters are refitted through ckpt-vllm's send_adapter, not "
                    "update_weights; sync merged weights (peft merge) here"
                )
            pairs = _blocking(weights, asyncio.get_running_loop(), self.timeout_s)
            version = None if global_steps is None else str(global_steps)
            if self._trainer is None:
                self._trainer = await asyncio.to_thread(self._connect)
            trainer = self._trainer
            try:
                await asyncio.to_thread(trainer.send_weights, pairs, weight_version=version)
            except BaseException:
                self._trainer = None  # it takes no more refits; the next sync connects again
                raise
        finally:
            close = getattr(weights, "aclose", None)
            if close is not None:  # a receive left unfinished (refused, failed) ends here, not at its deadline
                await close()

    def _connect(self) -> Any:
        from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo, CkptTrainerWeightTransferEngine

        info = CkptTrainerInitInfo(
            rank=0,
            transport=self.transport,
            bucket_size_bytes=self.bucket_size_bytes,
            rollout_world_size=self.rollout_world_size,
            engine_kwargs=self.engine_kwargs,
            rollout_engine_kwargs=self.server_engine_kwargs,
            timeout_s=self.timeout_s,
        )
        return CkptTrainerWeightTransferEngine.trainer_init(info, client=self.client)

    async def resume(self, tags: list[str]) -> None:
        """Nothing to do: the server keeps its weights and cache in place across a sync (its
        replica pauses and resumes generation around it)."""

    async def release(self) -> None:
        """Nothing to do (``resume``)."""

    def shutdown(self) -> None:
        """Ends this side's engine, if connected (the server keeps serving its last weights)."""
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            trainer.shutdown()


def _blocking(
    weights: Iterable[Pair] | AsyncIterator[Pair], loop: asyncio.AbstractEventLoop, timeout_s: float
) -> Iterator[Pair]:
    """``weights`` as a plain iterator for the refit's thread: an async iterator's items are
    awaited on ``loop`` (the adapter's, free while the refit runs), each within ``timeout_s``."""
    if not hasattr(weights, "__aiter__"):
        return iter(weights)  # type: ignore[arg-type]
    source = weights.__aiter__()

    def pairs() -> Iterator[Pair]:
        while True:
            future = asyncio.run_coroutine_threadsafe(source.__anext__(), loop)  # type: ignore[arg-type]
            try:
                yield future.result(timeout_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                future.cancel()
                raise TransferTimeoutError(
                    f"CkptVllmServerAdapter: no received tensor within timeout_s={timeout_s} s: the checkpoint "
                    "engine's receive stalled"
                ) from None

    return pairs()
