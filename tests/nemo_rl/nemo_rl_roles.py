"""NeMo RL's side of a checkpoint-engine refit, as its own code drives an engine.

Written from reading NeMo RL (``NVIDIA-NeMo/RL``), not copied from it: the calls, their order and
their arguments are NeMo RL's, taken from

* ``nemo_rl/utils/checkpoint_engines/base.py``: ``create_checkpoint_engine`` imports a
  ``"module:ClassName"`` backend itself and calls the class with ``bucket_size=`` and the
  engine options;
* ``nemo_rl/models/policy/workers/checkpoint_engine.py``: the policy worker's
  ``checkpoint_engine_rpc`` (``prepare`` adds the worker's ``"rank"`` to a dict result; the
  weights are sent under ``torch.no_grad()`` from inside a running event loop);
* ``nemo_rl/models/generation/vllm/checkpoint_engine.py``: the vLLM worker's methods, reached
  through ``collective_rpc(method, args=...)`` (``prepare`` adds ``"rank"`` and, with
  ``shard_expert_weights``, its ``"weight_layout"``; the receive loop loads each batch).

:class:`NemoRlWorker` is one such process; ``test_nemo_rl_sequence.py`` plays the synchronizer.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

from ckpt_core.orchestration.workload import digests
from ckpt_core.testing.weights import every_dtype, rank_dependent, sized

VLLM_METHODS = (
    "init_checkpoint_engine",
    "prepare_checkpoint_engine",
    "init_checkpoint_engine_process_group",
    "update_weights_from_checkpoint_engine",
    "finalize_checkpoint_engine",
)


def nemo_rl_create_checkpoint_engine(backend: str, *, bucket_size_bytes: int, engine_kwargs: dict[str, Any]) -> Any:
    """What NeMo RL's factory does with a ``"module:ClassName"`` backend (no registry)."""
    module_name, class_name = backend.split(":", 1)
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(bucket_size=bucket_size_bytes, **engine_kwargs)


def policy_weights(step: int, rank: int, bucket_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A policy rank's weights at ``step``: every dtype and edge case, tensors that differ
    per rank, and one tensor spread over three buckets."""
    params = {"seed": 7}
    return itertools.chain(
        every_dtype(params, refit_index=step, rank=rank),
        rank_dependent({**params, "count": 3, "elements": 1000}, refit_index=step, rank=rank),
        sized({**params, "sizes": [2 * bucket_size + 5]}, refit_index=step, rank=rank),
    )


def example_layout(rollout_rank: int, rollout_world_size: int) -> dict[str, Any]:
    """A layout shaped like NeMo RL's ``VllmWeightLayout``, different on every rollout rank."""
    return {
        "expert_params": {
            "model.layers.0.mlp.experts.routed_experts.w13_weight": {
                "tp_rank": rollout_rank,
                "tp_size": rollout_world_size,
                "local_expert_ids": None,
            }
        },
        "missing_weight_prefixes": [],
    }


class NemoRlWorker:
    """A NeMo RL policy worker or vLLM worker; :meth:`become` re-purposes the process."""

    def __init__(self) -> None:
        self.role = ""
        self.rank = -1
        self.rollout_world_size = 1  # a vLLM worker knows its world from vLLM
        self.checkpoint_engine: Any = None
        self.loaded: dict[str, torch.Tensor] = {}
        self.sent: dict[str, str] = {}

    def become(self, role: str, rank: int, rollout_world_size: int = 1) -> None:
        self.finalize()
        self.role, self.rank, self.rollout_world_size = role, rank, rollout_world_size
        self.checkpoint_engine = None
        self.loaded, self.sent = {}, {}

    def finalize(self) -> None:
        if self.checkpoint_engine is not None:
            self.checkpoint_engine.finalize()

    # --- the policy worker -------------------------------------------------------------

    def policy_rpc(self, checkpoint_method: str, method_kwargs: dict[str, Any] | None = None) -> Any:
        """``checkpoint_engine_rpc`` of a NeMo RL policy worker (an async Ray actor method)."""
        return asyncio.run(self._policy_rpc(checkpoint_method, method_kwargs))

    async def _policy_rpc(self, checkpoint_method: str, method_kwargs: dict[str, Any] | None) -> Any:
        kwargs = method_kwargs or {}
        if checkpoint_method == "init_checkpoint_engine":
            if self.checkpoint_engine is None:
                self.checkpoint_engine = nemo_rl_create_checkpoint_engine(
                    kwargs["backend"],
                    bucket_size_bytes=kwargs["bucket_size_bytes"],
                    engine_kwargs=kwargs["engine_kwargs"],
                )
            return None
        if checkpoint_method == "prepare_checkpoint_engine":
            metadata = self.checkpoint_engine.prepare()
            return {**metadata, "rank": self.rank} if isinstance(metadata, dict) else metadata
        if checkpoint_method == "init_checkpoint_engine_process_group":
            return self.checkpoint_engine.init_policy_process_group(worker_rank=self.rank, **kwargs)
        if checkpoint_method == "send_weights_via_checkpoint_engine":
            step = kwargs["step"]
            weights = policy_weights(step, self.rank, self.checkpoint_engine.bucket_size)
            expected = digests(policy_weights(step, self.rank, self.checkpoint_engine.bucket_size))
            with torch.no_grad():
                await self.checkpoint_engine.send_weights(weights)
            self.sent = expected
            return None
        if checkpoint_method == "finalize_checkpoint_engine":
            if self.checkpoint_engine is not None:
                self.checkpoint_engine.finalize()
            return None
        return getattr(self.checkpoint_engine, checkpoint_method)(**kwargs)

    def sent_digests(self) -> dict[str, str]:
        return self.sent

    # --- the vLLM worker ---------------------------------------------------------------

    def vllm_rpc(self, checkpoint_method: str, method_args: list[Any] | None = None) -> Any:
        """What ``collective_rpc(checkpoint_method, args=method_args)`` runs on one vLLM worker."""
        if checkpoint_method not in VLLM_METHODS:
            raise AttributeError(f"a vLLM worker has no checkpoint-engine method {checkpoint_method!r}")
        return getattr(self, checkpoint_method)(*(method_args or ()))

    def init_checkpoint_engine(self, backend: str, bucket_size_bytes: int, engine_kwargs: dict[str, Any]) -> None:
        if self.checkpoint_engine is None:
            self.checkpoint_engine = nemo_rl_create_checkpoint_engine(
                backend, bucket_size_bytes=bucket_size_bytes, engine_kwargs=engine_kwargs
            )

    def prepare_checkpoint_engine(self) -> Any:
        metadata = self.checkpoint_engine.prepare()
        if isinstance(metadata, dict):
            metadata = {**metadata, "rank": self.rank}
            if self.checkpoint_engine.shard_expert_weights:
                metadata["weight_layout"] = example_layout(self.rank, self.rollout_world_size)
        return metadata

    def init_checkpoint_engine_process_group(
        self, rank_prefix: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        # NeMo RL's resolve_rollout_rank: the engine-local rank plus the data-parallel prefix.
        self.checkpoint_engine.init_rollout_process_group(
            rollout_rank=rank_prefix + self.rank,
            train_world_size=train_world_size,
            rollout_world_size=rollout_world_size,
            metadata=metadata,
        )

    def update_weights_from_checkpoint_engine(self) -> bool:
        return asyncio.run(self._update_weights())

    async def _update_weights(self) -> bool:
        self.loaded = {}
        async for weight_batch in self.checkpoint_engine.receive_weight_batches():
            for name, tensor in weight_batch:  # received tensors own their memory: keep them
                self.loaded[name] = tensor
            del weight_batch
        return True

    def finalize_checkpoint_engine(self) -> None:
        if self.checkpoint_engine is not None:
            self.checkpoint_engine.finalize()

    def loaded_digests(self) -> dict[str, str]:
        """Name -> digest of what the last refit loaded, in the order it arrived."""
        return digests(self.loaded.items())
