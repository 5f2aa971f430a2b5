"""``python -m benchmarks.sharded``: a sharded refit against a full one, side by side in one run.

A tensor-parallel-2 rollout over ``gloo_cpu`` is fed by two policy processes (``--topology
paired``: policy rank i -> rollout rank i, as NeMo RL pairs a trainer's ranks with vLLM's) or by
one (``fanout``: one trainer, a stream of its own to each rollout rank). The weights
are a mixture-of-experts decoder (:func:`ckpt_core.testing.weights.tiny_moe`, sized by
``--hidden``/``--experts``/``--layers``), ready in each policy process's memory. Two pools run
at once, refits alternating: *full*, every rollout rank receiving every tensor, and
*sharded*, each rank publishing a destination layout (:mod:`ckpt_core.refit.layout`: attention split
by tensor parallelism, experts owned whole by one rank, the rest replicated) so that its sender
moves only what it keeps. Each refit is checked tensor by tensor (digests) once, before timing.

Reports medians of refit time and each rank's received bytes, and the issue's ratios: time
sharded / full (goal <= 0.6) and bytes sharded / full against 0.55 + the replicated share.
Writes ``sharded_<topology>.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ckpt_core.cli import parse_size
from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs
from ckpt_core.refit.layout import WeightLayout
from ckpt_core.testing.weights import Weights, tiny_moe, tiny_moe_layout

from .methods import worker_env
from .outputs import write_results

HERE = Path(__file__).resolve().parent
TP = 2
_READY: dict[int, list[tuple[str, torch.Tensor]]] = {}


def ready_moe(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """:func:`tiny_moe` made once per process for two versions, then ready in memory (a
    trainer's weights are: neither way of refitting is timed making them)."""
    version = refit_index % 2
    if version not in _READY:
        _READY[version] = list(tiny_moe(params, refit_index=version, rank=0))
    yield from _READY[version]


def open_pool(
    stack: contextlib.ExitStack,
    params: dict[str, Any],
    bucket_size: int,
    topology: str,
    layouts: list[WeightLayout] | None,
) -> RefitCoordinator:
    """RefitWorker processes (policy ranks, then the TP rollout ranks) set up; ``layouts``: sharded."""
    num_policy = TP if topology == "paired" else 1
    engine_kwargs: dict[str, Any] = {"topology": topology, "timeout_s": 120.0}
    if layouts is not None:
        engine_kwargs["shard_expert_weights"] = True
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=num_policy,
        num_rollout=TP,
        bucket_size=bucket_size,
        engine_kwargs=engine_kwargs,
        weights="benchmarks.sharded:ready_moe",
        weights_params=params,
        weight_layouts=[layout.to_json() for layout in layouts] if layouts else None,
    )
    tag = "sharded" if layouts else "full"
    pool = stack.enter_context(LocalProcessPool(specs, labels=[f"{tag}-{label}" for label in labels], env=worker_env()))
    coordinator = RefitCoordinator(pool, num_policy=num_policy, num_rollout=TP, timeout_s=300.0, topology=topology)
    coordinator.setup()
    stack.callback(coordinator.finalize)
    return coordinator


def timed_refit(coordinator: RefitCoordinator) -> tuple[float, list[int]]:
    start = time.perf_counter()
    report = coordinator.refit()
    seconds = time.perf_counter() - start
    return seconds, [int(r["stats"]["payload_bytes"]) for r in report.rollout]


def run(params: dict[str, Any], bucket_size: int, reps: int, topology: str) -> dict[str, Any]:
    shapes = {name: tuple(t.shape) for name, t in tiny_moe(params, refit_index=0, rank=0)}
    model_bytes = 2 * sum(torch.Size(s).numel() for s in shapes.values())
    layouts = [tiny_moe_layout(shapes, rank, TP) for rank in range(TP)]
    replicated = 2 * sum(
        torch.Size(kept.shape).numel()
        for name, kept in layouts[0].weights.items()
        if all(layout.weights[name].whole for layout in layouts)
    )
    rows: dict[str, list[dict[str, Any]]] = {"full": [], "sharded": []}
    with contextlib.ExitStack() as stack:
        opened = {
            "full": open_pool(stack, params, bucket_size, topology, None),
            "sharded": open_pool(stack, params, bucket_size, topology, layouts),
        }
        for coordinator in opened.values():  # warm-up, verified tensor by tensor
            coordinator.refit()
            coordinator.verify = False
        for _ in range(reps):
            for name, coordinator in opened.items():
                seconds, received = timed_refit(coordinator)
                rows[name].append({"seconds": seconds, "received_bytes": received})
                print(f"{name}: {seconds:.3f}s, received {[b >> 20 for b in received]} MiB per rank", flush=True)
    summary = {
        name: {
            "median_seconds": statistics.median(r["seconds"] for r in rs),
            "received_bytes_per_rank": rs[-1]["received_bytes"],
        }
        for name, rs in rows.items()
    }
    full_bytes = max(summary["full"]["received_bytes_per_rank"])
    sharded_bytes = max(summary["sharded"]["received_bytes_per_rank"])
    return {
        "topology": topology,
        "model": params,
        "model_bytes": model_bytes,
        "replicated_bytes": replicated,
        "bucket_size": bucket_size,
        "reps": rows,
        "summary": summary,
        "time_ratio": summary["sharded"]["median_seconds"] / summary["full"]["median_seconds"],
        "bytes_ratio": sharded_bytes / full_bytes,
        "bytes_bound_ratio": 0.55 + replicated / full_bytes,
        "kept_bytes_per_rank": [2 * layout.received_elements() for layout in layouts],
    }


def report_table(r: dict[str, Any]) -> str:
    s = r["summary"]
    mib = 1 << 20
    return "\n".join(
        [
            f"Sharded vs full refit, gloo_cpu {r['topology']} -> TP-2 rollout: a {r['model_bytes'] / mib:.0f} MiB MoE "
            f"({r['model']}), {r['bucket_size'] / mib:g} MiB buckets; medians of {len(r['reps']['full'])} "
            "alternating refits.",
            "",
            "| refit | time | received per rollout rank |",
            "| --- | --- | --- |",
            f"| full | {s['full']['median_seconds']:.3f} s | "
            f"{', '.join(f'{b / mib:.1f} MiB' for b in s['full']['received_bytes_per_rank'])} |",
            f"| sharded | {s['sharded']['median_seconds']:.3f} s | "
            f"{', '.join(f'{b / mib:.1f} MiB' for b in s['sharded']['received_bytes_per_rank'])} |",
            "",
            f"Time sharded / full: {r['time_ratio']:.2f} (goal <= 0.6). Bytes sharded / full: {r['bytes_ratio']:.3f} "
            f"(bound 0.55 + replicated {r['replicated_bytes'] / mib:.1f} MiB = {r['bytes_bound_ratio']:.3f}).",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-size", type=parse_size, default=32 << 20)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--topology", choices=("paired", "fanout"), default="fanout")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    params = {
        "seed": 1,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "experts": args.experts,
        "layers": args.layers,
        "vocab": args.vocab,
    }
    results = run(params, args.bucket_size, args.reps, args.topology)
    table = report_table(results)
    write_results(args.out, f"sharded_{args.topology}", results, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
