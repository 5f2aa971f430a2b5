"""The edges of the seed contract that NeMo RL's own code leans on, in one process.

Each test states what NeMo RL does (read from ``NVIDIA-NeMo/RL``) and checks that our code
gives it what it expects.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator
from typing import Any

import pytest
import torch

from ckpt_core import (
    CheckpointEngine,
    TensorMeta,
    create_checkpoint_engine,
    merge_weight_chunk_batches,
    split_weight_chunks,
)
from ckpt_core._internal.host_alloc import empty_host, pooled_bytes, release_host_pool
from ckpt_core.errors import EngineOptionError, InvalidArgumentError, LayoutUnavailableError, UnknownBackendError
from ckpt_core.orchestration.workload import digests
from ckpt_core.registry import check_engine_kwargs, resolve_backend
from ckpt_core.testing.weights import every_dtype, sized
from ckpt_core.transport import BucketedEngine, DistributedEngine

BACKENDS = ["gloo_cpu", "cuda_ipc", "nccl"]

# What NeMo RL's config hands a plugin engine (VllmCheckpointEnginePluginConfig.model_dump()
# without the bucket memory ratio: release_after_refit is always there), and the options of
# its own NIXL engine that a user carries over when switching transports.
NEMO_RL_OPTIONS = [
    {"release_after_refit": False},
    {"release_after_refit": True},
    {"release_after_refit": True, "shard_expert_weights": True},
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", NEMO_RL_OPTIONS, ids=["kept", "released", "sharded"])
def test_every_engine_takes_nemo_rl_options(backend: str, options: dict[str, Any]) -> None:
    check_engine_kwargs(resolve_backend(backend), options)


@pytest.mark.parametrize("backend,device", [("gloo_cpu", "cpu"), ("cuda_ipc", "cpu"), ("nccl", "cuda")])
def test_every_engine_takes_a_device(backend: str, device: str) -> None:
    check_engine_kwargs(resolve_backend(backend), {"device": device, "release_after_refit": True})


def test_the_options_mean_what_they_say_on_a_built_engine() -> None:
    engine = create_checkpoint_engine(
        "gloo_cpu",
        bucket_size_bytes=1 << 20,
        engine_kwargs={"release_after_refit": True, "shard_expert_weights": True, "device": "cpu"},
    )
    assert isinstance(engine, BucketedEngine)
    assert engine.release_after_refit is True and engine.shard_expert_weights is True
    assert type(engine).shard_expert_weights is False  # the class default is untouched


@pytest.mark.parametrize(
    "options,match",
    [
        ({"release_after_refits": True}, "did you mean 'release_after_refit'"),
        ({"release_after_refit": "yes"}, "release_after_refit must be True or False"),
        ({"shard_expert_weights": 1}, "shard_expert_weights must be True or False"),
        ({"device": "cuda"}, "device must be 'cpu'.*nccl"),
    ],
)
def test_a_wrong_option_is_still_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(EngineOptionError, match=match):
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs=options)


@pytest.mark.parametrize("release", [True, False])
def test_release_after_refit_decides_whether_finalize_returns_cached_memory(release: bool) -> None:
    release_host_pool()
    freed = empty_host(torch.Size([2 << 20]), torch.uint8)
    del freed  # a received tensor the loader dropped: its memory goes to the host pool
    assert pooled_bytes() > 0
    engine = create_checkpoint_engine(
        "gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs={"release_after_refit": release}
    )
    engine.finalize()
    assert (pooled_bytes() == 0) is release
    release_host_pool()


def test_unknown_backend_is_the_value_error_nemo_rl_callers_match() -> None:
    with pytest.raises(ValueError, match="Unknown checkpoint-engine backend 'nixll'") as info:
        create_checkpoint_engine("nixll", bucket_size_bytes=1 << 20, engine_kwargs={})
    assert isinstance(info.value, UnknownBackendError)


# --- get_target_weight_layout ----------------------------------------------------------------


class _NoLayoutEngine(CheckpointEngine):
    """An engine that implements the abstract methods and nothing else."""

    def prepare(self) -> Any:
        return {}

    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        pass

    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        pass

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        pass

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        yield []


def test_the_base_refuses_a_layout_it_does_not_have_as_nemo_rl_does() -> None:
    engine = _NoLayoutEngine()
    assert engine.get_target_weight_layout() is None
    engine.shard_expert_weights = True
    with pytest.raises(NotImplementedError, match="get_target_weight_layout") as info:
        engine.get_target_weight_layout()
    assert isinstance(info.value, LayoutUnavailableError)


def test_a_bucketed_engine_has_its_layout_only_once_initialized_as_policy() -> None:
    engine = create_checkpoint_engine(
        "gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs={"shard_expert_weights": True}
    )
    with pytest.raises(LayoutUnavailableError, match="init_policy_process_group"):
        engine.get_target_weight_layout()
    plain = create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs={})
    assert plain.get_target_weight_layout() is None


def _layouts_case(layouts: list[Any], topology: str = "broadcast") -> None:
    """Policy rank 0 of 1 initializing against ``len(layouts)`` rollout ranks' metadata."""
    options = {"shard_expert_weights": True, "topology": topology, "timeout_s": 5}
    engines = [
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs=options)
        for _ in range(1 + len(layouts))
    ]
    try:
        metadata = [engine.prepare() for engine in engines]
        for entry, layout in zip(metadata[1:], layouts):
            if layout is not None:
                entry["weight_layout"] = layout
        engines[0].init_policy_process_group(
            worker_rank=0, train_world_size=1, rollout_world_size=len(layouts), metadata=metadata
        )
    finally:
        for engine in engines:
            engine.finalize()


def test_a_missing_destination_layout_is_refused_at_init() -> None:
    with pytest.raises(InvalidArgumentError, match="rollout rank 1's prepare\\(\\) metadata has no 'weight_layout'"):
        _layouts_case([{"expert_params": {}}, None])


def test_one_broadcast_cannot_serve_different_layouts() -> None:
    with pytest.raises(EngineOptionError, match="layouts differ.*topology='paired'"):
        _layouts_case([{"tp_rank": 0}, {"tp_rank": 1}])


# --- an engine written against NeMo RL's base ------------------------------------------------


class _Fabric:
    """Where the engines below meet: one queue of buckets per policy engine, by name."""

    queues: dict[str, asyncio.Queue[Any]] = {}


class NixlStyleEngine(CheckpointEngine):
    """An engine shaped like NeMo RL's NIXL engine, on our base: constructed with
    ``bucket_size`` and its own options, it lays out its own buckets from
    ``split_weight_chunks`` (assigning each meta's ``offset`` itself), reads chunks back as
    views of its bucket buffer and merges them with ``merge_device="cpu"``."""

    def __init__(
        self,
        bucket_size: int,
        device: str = "cpu",
        shard_expert_weights: bool = False,
        release_after_refit: bool = False,
    ) -> None:
        self.bucket_size = bucket_size
        self.shard_expert_weights = shard_expert_weights
        self.release_after_refit = release_after_refit
        self.device = torch.device(device)
        self.name = ""
        self.peer = ""

    def prepare(self) -> dict[str, Any]:
        self.name = f"engine-{id(self)}"
        _Fabric.queues[self.name] = asyncio.Queue()
        return {"agent": self.name}

    def init_policy_process_group(
        self, *, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self.peer = self.name

    def init_rollout_process_group(
        self, *, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        self.peer = metadata[0]["agent"]

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        queue = _Fabric.queues[self.peer]
        buffer = torch.zeros(self.bucket_size, dtype=torch.uint8, device=self.device)
        offset, bucket = 0, list[TensorMeta]()
        for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            align = max(1, meta.dtype.itemsize)
            aligned = -(-offset // align) * align
            if aligned + meta.chunk_size > self.bucket_size:
                await queue.put((bucket, buffer.clone(), False))
                aligned, bucket = 0, []
            meta.offset = aligned  # the engine's own layout, as NIXL's send_weights does
            bucket.append(meta)
            buffer[aligned : aligned + meta.chunk_size].copy_(chunk)
            offset = aligned + meta.chunk_size
        await queue.put((bucket, buffer.clone(), True))

    async def _chunks(self) -> AsyncGenerator[list[tuple[TensorMeta, torch.Tensor]], None]:
        queue = _Fabric.queues[self.peer]
        while True:
            metas, buffer, last = await asyncio.wait_for(queue.get(), timeout=30)
            chunks = [(meta, buffer[int(meta.offset) : int(meta.offset) + meta.chunk_size]) for meta in metas]
            if chunks:
                yield chunks
            if last:
                return

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        async for batch in merge_weight_chunk_batches(self._chunks(), merge_device="cpu"):
            yield batch


def _weights() -> Generator[tuple[str, torch.Tensor], None, None]:
    yield from every_dtype({"seed": 3}, refit_index=0, rank=0)
    yield from sized({"seed": 3, "sizes": [3000, 1, 4097]}, refit_index=0, rank=0)


def test_an_engine_written_against_nemo_rls_base_runs_on_ours() -> None:
    engine_class = resolve_backend(f"{__name__}:NixlStyleEngine")
    check_engine_kwargs(engine_class, {"device": "cpu", "release_after_refit": True})
    options = {"device": "cpu", "release_after_refit": True}
    policy = create_checkpoint_engine(f"{__name__}:NixlStyleEngine", bucket_size_bytes=1024, engine_kwargs=options)
    rollout = create_checkpoint_engine(f"{__name__}:NixlStyleEngine", bucket_size_bytes=1024, engine_kwargs=options)

    async def refit() -> list[tuple[str, torch.Tensor]]:
        metadata = [policy.prepare(), rollout.prepare()]
        policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
        rollout.init_rollout_process_group(rollout_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
        received: list[tuple[str, torch.Tensor]] = []

        async def receive() -> None:
            async for batch in rollout.receive_weight_batches():
                received.extend(batch)

        await asyncio.gather(policy.send_weights(_weights()), receive())
        return received

    received = asyncio.run(refit())
    assert digests(received) == digests(_weights())
    assert list(digests(received)) == list(digests(_weights()))


# --- one set of options for every node -------------------------------------------------------


def test_host_auto_takes_each_nodes_own_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """NeMo RL gives every worker the same options, so no fixed address can be right on every
    node: ``host="auto"`` makes each worker resolve its own (``CKPT_CORE_HOST`` first)."""
    import socket

    monkeypatch.delenv("CKPT_CORE_HOST", raising=False)
    engine = create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs={"host": "auto"})
    assert isinstance(engine, DistributedEngine) and engine.host == socket.gethostbyname(socket.gethostname())
    monkeypatch.setenv("CKPT_CORE_HOST", "127.0.0.1")
    engine = create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1 << 20, engine_kwargs={"host": "auto"})
    assert isinstance(engine, DistributedEngine) and engine.host == "127.0.0.1"
    assert engine.prepare()["host"] == "127.0.0.1"  # what peers are told
    engine.finalize()


@pytest.mark.parametrize("backend", ["gloo_cpu", "cuda_ipc"])
def test_nemo_rls_own_factory_gets_the_same_named_option_error(backend: str) -> None:
    """NeMo RL builds an engine as ``EngineClass(bucket_size=..., **options)``, bypassing our
    factory: a misspelled option still gets our error, naming the closest accepted one."""
    engine_class = resolve_backend(backend)
    with pytest.raises(EngineOptionError, match="did you mean 'release_after_refit'") as info:
        engine_class(bucket_size=1 << 20, release_after_refits=True)  # type: ignore[call-arg]
    assert isinstance(info.value, TypeError)  # what Python's own error for it would have been
