"""``VllmWorkerPool``: a vLLM engine's ranks as rollout workers of a ``RefitCoordinator``.

Join it after the policy workers' pool (``JoinedPool(policy_pool, VllmWorkerPool(rollout))``)
and the coordinator drives vLLM with the same calls as any rollout worker: ``prepare``,
``init``, ``refit``, ``commit``, ``discard``, ``reset``, ``finalize``, each the
:class:`~ckpt_vllm.driver.rollout.VllmRollout` method of that name (``refit`` is its
``receive``). A vLLM engine's ranks are reached together (one ``collective_rpc``), so every
call must name each rank once, with the same arguments, as the coordinator's calls do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckpt_core.errors import InvalidArgumentError
from ckpt_core.orchestration.coordinator import CallResult, RefitFailedError
from ckpt_vllm.driver.rollout import VllmRollout

_METHODS = {  # a rollout worker's method -> VllmRollout's
    "prepare": "prepare",
    "init": "init",
    "refit": "receive",
    "commit": "commit",
    "discard": "discard",
    "reset": "reset",
    "finalize": "finalize",
    "status": "status",
}


class VllmWorkerPool:
    def __init__(self, rollout: VllmRollout) -> None:
        self.rollout = rollout

    def __len__(self) -> int:
        return self.rollout.world_size

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        """``VllmRollout.<method>(**kwargs)`` (``refit`` is its ``receive``: the coordinator
        commits): each rank's share of its value, or its failure."""
        method, kwargs = self._one_call_per_rank(calls)
        labels = [self.rollout.label(index) for index, _, _ in calls]
        try:
            value = getattr(self.rollout, _METHODS[method])(**kwargs)
        except RefitFailedError as exc:
            failed = {f.worker: f for f in exc.failures}
            return [failed.get(label, CallResult(label, True)) for label in labels]
        values = value if isinstance(value, list) else [value] * len(self)
        return [CallResult(label, True, values[index]) for label, (index, _, _) in zip(labels, calls)]

    def _one_call_per_rank(self, calls: Sequence[tuple[int, str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
        methods = {method for _, method, _ in calls}
        if len(methods) != 1 or sorted(i for i, _, _ in calls) != list(range(len(self))):
            raise InvalidArgumentError(
                f"a vLLM engine's {len(self)} ranks are called together, each once with one method; got "
                f"{[(i, m) for i, m, _ in calls]}"
            )
        (method,) = methods
        if method not in _METHODS:
            raise InvalidArgumentError(f"a vLLM rollout worker has no {method!r} (it has {', '.join(_METHODS)})")
        kwargs = calls[0][2]
        if any(k != kwargs for _, _, k in calls):
            raise InvalidArgumentError(f"{method}() must get the same arguments on every rank of a vLLM engine")
        return method, dict(kwargs)
