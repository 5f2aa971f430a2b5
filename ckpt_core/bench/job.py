"""The ``ckpt-engine bench`` job: refits between local processes, measured beside raw Gloo.

Every received tensor is checked bit-exact against its source (per-tensor digests). The
transport floor (raw ``torch.distributed`` Gloo moving the same bytes as one tensor) is
measured in the same run, so the ratio between them holds on a noisy machine.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from ckpt_core.orchestration.coordinator import RefitCoordinator, WorkerPool
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_core.topology import Topology

_STAT_FIELDS = ("seconds", "pack_seconds", "transfer_seconds", "unpack_seconds", "checksum_seconds")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    backend: str = "gloo_cpu"
    size_bytes: int | None = 1 << 30
    model: str | None = None
    bucket_size: int = 64 << 20
    num_policy: int = 1
    num_rollout: int = 2
    refits: int = 3
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    baseline: bool = True
    progress: bool = False
    launcher: str = "local"
    """``"local"`` (subprocesses) or ``"ray"`` (Ray actors; the raw Gloo floor stays local)."""
    ray_address: str | None = None
    """With ``launcher="ray"``: the cluster to join; ``None`` starts a local one."""
    produce: str | None = None
    """Make each weight as the refit asks for it (:mod:`ckpt_core.bench.produce`), or ``None``
    to send weights made ready before the refit."""

    @property
    def topology(self) -> str:
        return str(self.engine_kwargs.get("topology", "broadcast"))

    @property
    def timeout_s(self) -> float:
        return float(self.engine_kwargs.get("timeout_s", 300.0)) + 60.0


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run one warm-up and ``config.refits`` timed refits, then the raw Gloo floor."""
    if config.refits < 1:
        raise ValueError(f"refits must be >= 1, got {config.refits}")
    params: dict[str, Any]
    if config.model:
        weights, params = "ckpt_core.bench.synthetic:safetensors_weights", {"path": config.model}
    else:
        weights, params = "ckpt_core.bench.synthetic:transformer_weights", {"size_bytes": config.size_bytes}
    if config.produce is not None:
        params = {"mode": config.produce, "source": weights, "source_params": params}
        weights = "ckpt_core.bench.produce:produced_weights"
    specs, labels = refit_worker_specs(
        backend=config.backend,
        num_policy=config.num_policy,
        num_rollout=config.num_rollout,
        bucket_size=config.bucket_size,
        engine_kwargs=config.engine_kwargs,
        weights=weights,
        weights_params=params,
    )
    if config.progress:
        specs[config.num_policy]["hook_plugins"] = ["ckpt_core.bench.progress:ProgressBar"]
    with _refit_pool(config, specs, labels) as pool:
        coordinator = RefitCoordinator(
            pool,
            num_policy=config.num_policy,
            num_rollout=config.num_rollout,
            timeout_s=config.timeout_s,
            topology=config.topology,
        )
        coordinator.setup()
        try:
            coordinator.refit()  # warm-up: first-touch page faults, materializing weights
            reports = [coordinator.refit() for _ in range(config.refits)]
        finally:
            coordinator.finalize()
    per_worker = [
        _summarize(
            labels[i], [r.policy[i] if i < config.num_policy else r.rollout[i - config.num_policy] for r in reports]
        )
        for i in range(len(labels))
    ]
    active = [w for w in per_worker[config.num_policy :]]
    payload = reports[-1].rollout[0]["stats"]["payload_bytes"]
    result: dict[str, Any] = {
        "config": {**dataclasses.asdict(config), "topology": config.topology},
        "payload_bytes": payload,
        "tensors": reports[-1].rollout[0]["tensors"],
        "policy": per_worker[: config.num_policy],
        "rollout": active,
        "gbps": min(w["gbps"] for w in active),
    }
    if config.baseline:
        floor = measure_gloo_floor(payload, config.topology, config.num_rollout, config.refits, config.timeout_s)
        result["baseline"] = floor
        result["ratio_to_baseline"] = result["gbps"] / floor["gbps"] if floor["gbps"] else 0.0
    return result


def _refit_pool(
    config: BenchConfig, specs: Sequence[dict[str, Any]], labels: Sequence[str]
) -> AbstractContextManager[WorkerPool]:
    if config.launcher == "ray":
        from ckpt_core.orchestration.ray import ray_service_pool

        return ray_service_pool(specs, labels, address=config.ray_address)
    if config.launcher != "local":
        raise ValueError(f"launcher must be 'local' or 'ray', got {config.launcher!r}")
    return LocalProcessPool(specs, labels=labels)


def _summarize(label: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    stats = [r["stats"] for r in results if r["stats"]]
    summary: dict[str, Any] = {"label": label}
    for field in _STAT_FIELDS:
        summary[field] = statistics.median(s[field] for s in stats) if stats else 0.0
    payload = stats[-1]["payload_bytes"] if stats else 0
    summary["payload_bytes"] = payload
    summary["gbps"] = payload / summary["seconds"] / 1e9 if summary["seconds"] else 0.0
    summary["lifetime_peak_rss_bytes"] = results[-1]["lifetime_peak_rss_bytes"]
    return summary


def measure_gloo_floor(nbytes: int, topology: str, num_rollout: int, refits: int, timeout_s: float) -> dict[str, Any]:
    """Median GB/s of raw Gloo moving ``nbytes`` as one tensor (after one warm-up), to every
    receiver by broadcast, or from one sender to one receiver for ``paired``."""
    size = num_rollout + 1 if Topology.parse(topology).shares_link else 2
    specs = [{"service": "ckpt_core.bench.baselines:RawGlooWorker", "rank": r, "size": size} for r in range(size)]
    labels = ["raw sender"] + [f"raw receiver {r}" for r in range(1, size)]
    with LocalProcessPool(specs, labels=labels) as pool:
        coordinator_calls = pool.call([(r, "prepare", {}) for r in range(size)], timeout_s)
        _raise_failures("raw Gloo prepare", coordinator_calls)
        metadata = [c.value for c in coordinator_calls]
        _raise_failures(
            "raw Gloo init", pool.call([(r, "init", {"metadata": metadata}) for r in range(size)], timeout_s)
        )
        kwargs = {"nbytes": nbytes, "topology": topology, "repetitions": refits + 1}
        runs = pool.call([(r, "transfer", kwargs) for r in range(size)], timeout_s)
        _raise_failures("raw Gloo transfer", runs)
    receivers = [c.value for c in runs[1:]]
    per_rep = [max(r["seconds"][i] for r in receivers) for i in range(1, refits + 1)]
    median = statistics.median(per_rep)
    return {
        "topology": topology,
        "nbytes": nbytes,
        "seconds": per_rep,
        "gbps": nbytes / median / 1e9,
        "lifetime_peak_rss_bytes": [c.value["lifetime_peak_rss_bytes"] for c in runs],
    }


def _raise_failures(step: str, results: list[Any]) -> None:
    failed = [r for r in results if not r.ok]
    if failed:
        from ckpt_core.orchestration.coordinator import RefitFailedError

        raise RefitFailedError(step, failed)
