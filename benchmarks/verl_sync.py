"""``python -m benchmarks.verl_sync``: a verl weight sync over ckpt-core engines, rebuild included.

verl's ``CheckpointEngineManager.update_weights`` rebuilds the transfer group at every sync:
``prepare`` on every worker, the engine class's ``build_topology``, ``init_process_group`` on
every worker, then ``send_weights`` beside ``receive_weights``, then ``finalize``. Measured here
the same way, between real processes (one trainer, ``--rollouts`` rollout workers, each engine
built as verl builds it: ``CheckpointEngineRegistry.new("ckpt_<backend>", bucket_size=...)``),
``--syncs`` syncs per backend after one warm-up, for each of ``--backends``:

* **sync**: the whole sync, as the driver sees it (from the first ``prepare`` to the last
  ``finalize``), and its parts: **rebuild** (prepare, topology, init and finalize) and
  **transfer** (send beside receive, until the last rollout holds every tensor);
* **verl's own**: every engine verl ships, built the same way and asked to ``prepare()``, or
  the import error verl recorded for its module. In verl 0.9.1 on a CPU, ``naive`` is the only
  one that imports, and it is colocated only (verl's manager short-circuits it to an in-process
  hand-over), so between processes there is nothing of verl's to time; what each answers is
  recorded beside our figures.

The issue's goal (issue 51, point 5): >= 2x faster than verl's own engine on CPU. Writes
``verl_sync.json`` and ``verl_sync.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from ckpt_core.cli import parse_size
from ckpt_core.orchestration.local import LocalProcessPool

from .methods import worker_env
from .outputs import write_results

HERE = Path(__file__).resolve().parent
BACKENDS = {"gloo_cpu": {}, "cuda_ipc": {"device": "cpu"}}
TIMEOUT_S = 120.0


class VerlSyncWorker:
    """One verl worker: an engine built as verl builds it, its weights (a trainer's) made once."""

    def __init__(
        self, *, backend: str, role: str, bucket_size: int, engine_kwargs: dict[str, Any], nbytes: int, tensors: int
    ) -> None:
        import verl  # noqa: F401 - loads the verl.plugins entry points, ckpt-verl's among them
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        self.role = role
        extra = {"is_master": True} if role == "trainer" else {}
        self.registry = CheckpointEngineRegistry
        self.backend = backend
        self.engine = CheckpointEngineRegistry.new(backend, bucket_size=bucket_size, **extra, **engine_kwargs)
        generator = torch.Generator().manual_seed(0)
        elements = nbytes // (2 * tensors)
        self.weights = (
            [
                (f"model.layers.{i}.weight", torch.randn(elements, generator=generator).bfloat16())
                for i in range(tensors)
            ]
            if role == "trainer"
            else []
        )

    def prepare(self) -> dict[str, Any]:
        return self.engine.prepare()

    def build_topology(self, *, rollouts: int, metadata: list[dict[str, Any]]) -> list[Any]:
        trainer, rollout = self.registry.get(self.backend).build_topology(1, rollouts, metadata)
        return [trainer, rollout]

    def init_process_group(self, **kwargs: Any) -> None:
        self.engine.init_process_group(**kwargs)

    def sync(self, *, global_steps: int) -> dict[str, Any]:
        if self.role == "trainer":
            weights: Generator[tuple[str, torch.Tensor], None, None] = (item for item in self.weights)
            asyncio.run(self.engine.send_weights(weights, global_steps=global_steps))
            return {"ended_at": time.perf_counter()}

        async def receive() -> int:
            return sum(
                [
                    tensor.numel() * tensor.element_size()
                    async for _, tensor in self.engine.receive_weights(global_steps=global_steps)
                ]
            )

        received = asyncio.run(receive())
        return {"ended_at": time.perf_counter(), "bytes": received}

    def finalize(self) -> None:
        self.engine.finalize()

    def verls_own(self, *, bucket_size: int) -> dict[str, str]:
        """What each of verl's own engines answers here: built as verl builds it and asked to
        ``prepare()`` (``"prepared"`` if it did), or, for an engine module verl could not import,
        the import error verl recorded. Ours (``ckpt_*``) are left out."""
        from ckpt_verl.engine import PREFIX

        answers = {}
        for name in sorted(self.registry._registry):
            if name.startswith(PREFIX):
                continue
            try:
                self.registry.new(name, bucket_size=bucket_size).prepare()
            except Exception as exc:  # noqa: BLE001 - the answer is the finding
                answers[name] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                answers[name] = "prepared"
        for module, error in sorted(self.registry._import_errors.items()):
            answers[module] = f"not importable: {error}"
        return answers


def _call(pool: LocalProcessPool, method: str, per_worker: dict[int, dict[str, Any]]) -> dict[int, Any]:
    results = pool.call([(index, method, kwargs) for index, kwargs in per_worker.items()], TIMEOUT_S)
    failed = [result.describe() for result in results if not result.ok]
    if failed:
        raise RuntimeError("\n".join(failed))
    return {index: result.value for index, result in zip(per_worker, results)}


def one_sync(pool: LocalProcessPool, rollouts: int, global_steps: int) -> dict[str, float]:
    workers = list(range(1 + rollouts))
    start = time.perf_counter()
    prepared = _call(pool, "prepare", dict.fromkeys(workers, {}))
    metadata = [prepared[index] for index in workers]
    trainer_kwargs, rollout_kwargs = _call(pool, "build_topology", {0: {"rollouts": rollouts, "metadata": metadata}})[0]
    init = {0: {key: values[0] for key, values in trainer_kwargs.items()}}
    for position in range(rollouts):
        init[1 + position] = {key: values[position] for key, values in rollout_kwargs.items()}
    _call(pool, "init_process_group", init)
    sent = time.perf_counter()
    ended = _call(pool, "sync", dict.fromkeys(workers, {"global_steps": global_steps}))
    transferred = max(value["ended_at"] for value in ended.values())
    finalize_start = time.perf_counter()
    _call(pool, "finalize", dict.fromkeys(workers, {}))
    end = time.perf_counter()
    return {
        "sync_s": end - start,
        "rebuild_s": (sent - start) + (end - finalize_start),
        "transfer_s": transferred - sent,
    }


def measure(backend: str, rollouts: int, nbytes: int, tensors: int, bucket_size: int, syncs: int) -> dict[str, Any]:
    kwargs: dict[str, Any] = {**BACKENDS[backend], "timeout_s": TIMEOUT_S}
    common = {"bucket_size": bucket_size, "engine_kwargs": kwargs, "nbytes": nbytes, "tensors": tensors}
    specs = [
        {"service": "benchmarks.verl_sync:VerlSyncWorker", "backend": f"ckpt_{backend}", "role": "trainer", **common}
    ]
    specs += [
        {"service": "benchmarks.verl_sync:VerlSyncWorker", "backend": f"ckpt_{backend}", "role": "rollout", **common}
        for _ in range(rollouts)
    ]
    labels = ["trainer"] + [f"rollout{i}" for i in range(rollouts)]
    with LocalProcessPool(specs, labels=labels, env=worker_env()) as pool:
        one_sync(pool, rollouts, global_steps=0)  # warm-up
        runs = [one_sync(pool, rollouts, global_steps=step) for step in range(1, syncs + 1)]
        verls_own = _call(pool, "verls_own", {0: {"bucket_size": bucket_size}})[0]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return {"backend": backend, "runs": runs, "medians": medians, "verls_own": verls_own}


def report(results: dict[str, Any]) -> str:
    setup = results["setup"]
    lines = [
        f"A verl sync, 1 trainer -> {setup['rollouts']} rollout workers, {setup['nbytes'] / 2**20:.0f} MiB in "
        f"{setup['tensors']} bf16 tensors, {setup['bucket_size'] >> 20} MiB buckets; medians of {setup['syncs']} "
        "syncs after a warm-up, the group rebuilt each sync as verl's manager does.",
        "",
        "| engine | sync | rebuild (prepare, topology, init, finalize) | transfer | GB/s (transfer) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run in results["runs"]:
        m = run["medians"]
        lines.append(
            f"| ckpt_{run['backend']} | {m['sync_s'] * 1e3:.0f} ms | {m['rebuild_s'] * 1e3:.0f} ms | "
            f"{m['transfer_s'] * 1e3:.0f} ms | {setup['nbytes'] / m['transfer_s'] / 1e9:.2f} |"
        )
    answers = results["runs"][0]["verls_own"] if results["runs"] else {}
    lines += ["", "verl's own engines on this machine (built as verl builds them, then `prepare()`):", ""]
    lines += ["| verl engine | answer |", "| --- | --- |"]
    lines += [f"| `{name}` | {answer} |" for name, answer in answers.items()]
    lines += [
        "",
        "Goal (issue 51, point 5): >= 2x faster than verl's own engine on CPU. verl 0.9.1 has no engine that moves "
        "weights between processes without CUDA (`naive` is colocated; the manager hands weights over in process), "
        "so there is no figure of verl's to hold ours against on this machine.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=256 << 20)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--bucket-size", type=parse_size, default=64 << 20)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=sorted(BACKENDS))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    setup = {
        "nbytes": args.size,
        "tensors": args.tensors,
        "bucket_size": args.bucket_size,
        "rollouts": args.rollouts,
        "syncs": args.syncs,
    }
    runs = [measure(b, args.rollouts, args.size, args.tensors, args.bucket_size, args.syncs) for b in args.backends]
    results = {"setup": setup, "runs": runs}
    table = report(results)
    write_results(args.out, "verl_sync", results, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
