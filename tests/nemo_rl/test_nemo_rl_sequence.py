"""Our engines driven the way NeMo RL drives a checkpoint engine, worker processes and all.

The test plays NeMo RL's ``CheckpointEngineWeightSynchronizer``
(``nemo_rl/weight_sync/checkpoint_engine_weight_synchronizer.py``): per refit it makes sure the
engines are ready (create on every worker, ``prepare`` on every worker, the metadata flattened
and sorted by the ``"rank"`` key the workers add, then the process-group init on both sides at
once), runs the send and the receive at once, and, with ``release_after_refit``, finalizes
every engine afterwards, so the next refit prepares and connects the same engine objects
again. The workers (:mod:`nemo_rl_roles`) are NeMo RL's policy and vLLM worker methods. The
engines are named the way a NeMo RL config names a plugin (``"module:ClassName"``) and built
with the options NeMo RL's config gives a plugin engine (``release_after_refit`` always there).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from ckpt_core.orchestration.coordinator import CallResult
from ckpt_core.orchestration.local import LocalProcessPool

HERE = Path(__file__).resolve().parent
SERVICE = {"service": "tests.nemo_rl.nemo_rl_roles:NemoRlWorker"}
BUCKET = 1 << 20  # NeMo RL refuses buckets under 1 MiB
TIMEOUT_S = 120.0
GLOO = "ckpt_gloo_cpu.engine:GlooCpuCheckpointEngine"
CUDA_IPC = "ckpt_cuda_ipc.engine:CudaIpcCheckpointEngine"


@dataclasses.dataclass(frozen=True)
class Case:
    backend: str
    num_policy: int
    num_rollout: int
    engine_kwargs: dict[str, Any]

    def source(self, rollout_rank: int) -> int:
        return rollout_rank if self.engine_kwargs.get("topology") == "paired" else 0


CASES = [
    pytest.param(Case(GLOO, 1, 1, {"release_after_refit": True, "timeout_s": 60}), id="gloo-1to1"),
    pytest.param(
        Case(GLOO, 2, 1, {"release_after_refit": True, "topology": "broadcast", "host": "auto", "timeout_s": 60}),
        id="gloo-2to1-broadcast",
    ),
    pytest.param(
        Case(
            GLOO,
            2,
            2,
            {"release_after_refit": True, "topology": "paired", "shard_expert_weights": True, "timeout_s": 60},
        ),
        id="gloo-2to2-paired-sharded",
    ),
    pytest.param(
        Case(CUDA_IPC, 1, 2, {"release_after_refit": True, "device": "cpu", "timeout_s": 60}), id="cuda_ipc-cpu-1to2"
    ),
    pytest.param(Case(GLOO, 1, 1, {"release_after_refit": False, "timeout_s": 60}), id="gloo-1to1-kept"),
]


@pytest.fixture(scope="module")
def pool() -> Any:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[1]), env.get("PYTHONPATH")]))
    with LocalProcessPool(
        [SERVICE] * 4, labels=[f"worker {i}" for i in range(4)], env=env, start_timeout_s=300
    ) as workers:
        yield workers


def _ok(results: list[CallResult]) -> list[Any]:
    failed = [r for r in results if not r.ok]
    assert not failed, "\n".join(r.describe() for r in failed)
    return [r.value for r in results]


def _sorted_by_rank(metadata: list[Any]) -> list[Any]:
    """NeMo RL's ``_sort_ranked_metadata``."""
    if all(isinstance(item, dict) and "rank" in item for item in metadata):
        return sorted(metadata, key=lambda item: item["rank"])
    return metadata


class Synchronizer:
    """NeMo RL's synchronizer over ``pool``: policy workers first, then one vLLM engine whose
    tensor-parallel workers are the rollout processes (``rank_prefix`` 0)."""

    def __init__(self, pool: LocalProcessPool, case: Case) -> None:
        self.pool, self.case = pool, case
        self.policy = list(range(case.num_policy))
        self.rollout = list(range(case.num_policy, case.num_policy + case.num_rollout))
        self.ready = False
        _ok(
            pool.call(
                [(w, "become", {"role": "policy", "rank": r}) for r, w in enumerate(self.policy)]
                + [
                    (w, "become", {"role": "rollout", "rank": r, "rollout_world_size": case.num_rollout})
                    for r, w in enumerate(self.rollout)
                ],
                TIMEOUT_S,
            )
        )

    def _policy(
        self, method: str, workers: list[int] | None = None, **kwargs: Any
    ) -> list[tuple[int, str, dict[str, Any]]]:
        return [
            (w, "policy_rpc", {"checkpoint_method": method, "method_kwargs": kwargs}) for w in workers or self.policy
        ]

    def _vllm(
        self, method: str, args: list[Any] | None = None, workers: list[int] | None = None
    ) -> list[tuple[int, str, dict[str, Any]]]:
        return [
            (w, "vllm_rpc", {"checkpoint_method": method, "method_args": args or []}) for w in workers or self.rollout
        ]

    def ensure_ready(self) -> None:
        if self.ready:
            return
        case = self.case
        _ok(
            self.pool.call(
                self._policy(
                    "init_checkpoint_engine",
                    backend=case.backend,
                    bucket_size_bytes=BUCKET,
                    engine_kwargs=case.engine_kwargs,
                )
                + self._vllm("init_checkpoint_engine", [case.backend, BUCKET, case.engine_kwargs]),
                TIMEOUT_S,
            )
        )
        # Results arrive in whatever order the workers were listed; asking in reverse shows
        # that the engines get the order NeMo RL restores from the "rank" key.
        backwards_policy, backwards_rollout = self.policy[::-1], self.rollout[::-1]
        prepared = _ok(
            self.pool.call(
                self._policy("prepare_checkpoint_engine", backwards_policy)
                + self._vllm("prepare_checkpoint_engine", workers=backwards_rollout),
                TIMEOUT_S,
            )
        )
        policy_metadata = _sorted_by_rank(prepared[: len(self.policy)])
        rollout_metadata = _sorted_by_rank(prepared[len(self.policy) :])
        metadata = policy_metadata + rollout_metadata
        _ok(
            self.pool.call(
                self._policy(
                    "init_checkpoint_engine_process_group",
                    metadata=metadata,
                    train_world_size=len(policy_metadata),
                    rollout_world_size=len(rollout_metadata),
                )
                + self._vllm(
                    "init_checkpoint_engine_process_group", [0, len(policy_metadata), len(rollout_metadata), metadata]
                ),
                TIMEOUT_S,
            )
        )
        self.ready = True

    def sync_weights(self, step: int) -> None:
        self.ensure_ready()
        try:
            results = _ok(
                self.pool.call(
                    self._policy("send_weights_via_checkpoint_engine", step=step)
                    + self._vllm("update_weights_from_checkpoint_engine"),
                    TIMEOUT_S,
                )
            )
            assert all(results[len(self.policy) :]), "a vLLM worker reported a failed weight update"
        finally:
            if self.case.engine_kwargs["release_after_refit"]:
                self.shutdown()

    def shutdown(self) -> None:
        if self.ready:
            _ok(
                self.pool.call(
                    self._policy("finalize_checkpoint_engine") + self._vllm("finalize_checkpoint_engine"), TIMEOUT_S
                )
            )
            self.ready = False

    def check_bit_exact(self) -> None:
        sent = _ok(self.pool.call([(w, "sent_digests", {}) for w in self.policy], TIMEOUT_S))
        loaded = _ok(self.pool.call([(w, "loaded_digests", {}) for w in self.rollout], TIMEOUT_S))
        for rank, got in enumerate(loaded):
            want = sent[self.case.source(rank)]
            assert list(got) == list(want), f"rollout rank {rank}: names or order differ"
            differ = [name for name in want if got[name] != want[name]]
            assert not differ, f"rollout rank {rank}: not bit-exact: {differ}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_nemo_rl_drives_two_refits_bit_exact(pool: LocalProcessPool, case: Case) -> None:
    sync = Synchronizer(pool, case)
    try:
        for step in (1, 2):
            sync.sync_weights(step)
            sync.check_bit_exact()
        if case.engine_kwargs.get("shard_expert_weights"):
            sync.ensure_ready()
            layouts = _ok(pool.call(sync._policy("get_target_weight_layout"), TIMEOUT_S))
            for rank, layout in enumerate(layouts):
                params = layout["expert_params"]["model.layers.0.mlp.experts.routed_experts.w13_weight"]
                assert (params["tp_rank"], params["tp_size"]) == (rank, case.num_rollout)
    finally:
        sync.shutdown()
