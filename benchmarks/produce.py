"""``python -m benchmarks.produce``: refits of weights made while the refit runs, side by side.

A trainer makes each rollout weight when the refit asks for it (see
:mod:`ckpt_core.bench.produce`). For each way of producing (``cast-bf16``: fp32 masters cast to
bf16; ``fill``: each tensor allocated and filled), one run measures, round-robin, repetition by
repetition:

* the refit: ``gloo_cpu`` paired, 1 policy -> 1 rollout, with the producing generator;
* producing alone: the same generator run to its end in one process, with the threads the
  refit's policy process has (and, for reference, with every core);
* the raw transfer alone: raw Gloo moving the produced bytes as one tensor;
* the naive loop: produce a tensor, ``send`` it, repeat (the receiver allocates and receives);
* the ready-weights refit of the same payload, for reference.

It reports medians and the ratios the performance issue sets: refit speed-up over the naive
loop (minimum 2x), refit time over produce + raw (at most 0.85x) and over max(produce, raw)
(goal 1.2x: production hidden). Writes ``produce.json`` and ``produce.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckpt_core.bench import PRODUCE_MODES
from ckpt_core.cli import parse_size

from .methods import FloorMethod, Method, NaiveLoopMethod, ProduceMethod, RefitMethod
from .weights import Payload, write_payload


def produced(payload: Payload, mode: str) -> Payload:
    """``payload`` made anew as it is sent (its size is that of what is produced)."""
    params = {"mode": mode, "source": payload.weights, "source_params": payload.weights_params}
    return Payload(
        label=f"{payload.label} {mode}",
        payload_bytes=0,  # filled in from the producer's first run
        tensors=payload.tensors,
        largest_tensor_bytes=payload.largest_tensor_bytes,
        weights="ckpt_core.bench.produce:produced_weights",
        weights_params=params,
    )


def _with_size(payload: Payload, layout: list[dict[str, Any]]) -> Payload:
    import torch

    from ckpt_core._internal.dtypes import dtype_from_name

    nbytes = sum(torch.Size(e["shape"]).numel() * dtype_from_name(e["dtype"]).itemsize for e in layout)
    return Payload(**{**payload.to_dict(), "payload_bytes": nbytes})


def _gloo_paired_refit(key: str, label: str, bucket_size: int, timeout_s: float) -> RefitMethod:
    return RefitMethod(
        key=key,
        label=label,
        backend="gloo_cpu",
        num_rollout=1,
        bucket_size=bucket_size,
        engine_kwargs={"topology": "paired"},
        topology="paired",
        timeout_s=timeout_s,
    )


def run(size: int, bucket_size: int, reps: int, modes: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    producer_threads = max(1, (os.cpu_count() or 2) // 2)  # the refit's policy process's share
    results: dict[str, Any] = {
        "size_bytes": size,
        "bucket_size": bucket_size,
        "reps": reps,
        "produce_threads": producer_threads,
        "modes": {},
    }
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="ckpt-produce-") as scratch:
        ready = write_payload(Path(scratch) / "payload", size, label=f"{size >> 20} MiB")
        for mode in modes:
            # The refit's policy process gets its share of the cores (LocalProcessPool gives
            # each of its two workers half), so producing alone is measured with that share;
            # with every core, beside it, for reference.
            producer = ProduceMethod(
                key="produce", label="producing alone", timeout_s=timeout_s, threads=producer_threads
            )
            methods: list[Method] = [
                producer,
                ProduceMethod(key="produce_all_cores", label="producing alone, every core", timeout_s=timeout_s),
                _gloo_paired_refit("refit", "gloo_cpu paired refit, produced", bucket_size, timeout_s),
                FloorMethod(
                    key="raw",
                    label="raw Gloo send/recv, produced bytes",
                    topology="paired",
                    num_receivers=1,
                    timeout_s=timeout_s,
                ),
                NaiveLoopMethod(
                    key="naive", label="naive produce-then-send loop", layout=producer, timeout_s=timeout_s
                ),
                _gloo_paired_refit("refit_ready", "gloo_cpu paired refit, ready weights", bucket_size, timeout_s),
            ]
            payload = produced(ready, mode)
            seconds: dict[str, list[float]] = {m.key: [] for m in methods}
            try:
                for method in methods:
                    method.open()
                producer.warm_up(payload)
                payload = _with_size(payload, producer.layout)
                for method in methods[1:]:
                    method.warm_up(ready if method.key == "refit_ready" else payload)
                for _ in range(reps):
                    for method in methods:
                        sample = method.sample(ready if method.key == "refit_ready" else payload)
                        seconds[method.key].append(sample.seconds)
            finally:
                for method in methods:
                    method.close()
            median = {key: statistics.median(values) for key, values in seconds.items()}
            results["modes"][mode] = {
                "payload_bytes": payload.payload_bytes,
                "ready_payload_bytes": ready.payload_bytes,
                "tensors": payload.tensors,
                "seconds": seconds,
                "median_seconds": median,
                "gbps": {
                    k: (ready.payload_bytes if k == "refit_ready" else payload.payload_bytes) / v / 1e9
                    for k, v in median.items()
                },  # fmt: skip
                "speedup_over_naive": median["naive"] / median["refit"],
                "over_produce_plus_raw": median["refit"] / (median["produce"] + median["raw"]),
                "over_max_produce_raw": median["refit"] / max(median["produce"], median["raw"]),
            }
    out.mkdir(parents=True, exist_ok=True)
    (out / "produce.json").write_text(json.dumps(results, indent=2))
    (out / "produce.md").write_text(report(results))
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        f"Weights produced during the refit: {results['size_bytes'] >> 20} MiB transformer-shaped payload, "
        f"buckets of {results['bucket_size'] >> 20} MiB, medians of {results['reps']} round-robin repetitions.",
        "",
        "| mode | produced MiB | refit GB/s | produce alone s | (every core) | raw transfer s | naive loop s "
        "| refit s | x naive | / (produce + raw) | / max(produce, raw) | ready-weights refit GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in results["modes"].items():
        m = r["median_seconds"]
        lines.append(
            f"| {mode} | {r['payload_bytes'] / 2**20:.0f} | {r['gbps']['refit']:.2f} | {m['produce']:.3f} | "
            f"{m['produce_all_cores']:.3f} | {m['raw']:.3f} | {m['naive']:.3f} | {m['refit']:.3f} | "
            f"{r['speedup_over_naive']:.2f}x | "
            f"{r['over_produce_plus_raw']:.2f}x | {r['over_max_produce_raw']:.2f}x | {r['gbps']['refit_ready']:.2f} |"
        )
    lines += [
        "",
        "Targets: x naive >= 2 and / (produce + raw) <= 0.85 (minimum); / max(produce, raw) <= 1.2 (goal).",
        "Producing alone runs with the threads the refit's policy process has (half the cores: the other",
        "half carries the transfer and the receiver); the column beside it used every core.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.produce", description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("512MiB"), help="payload (default 512MiB)")
    parser.add_argument("--bucket-size", type=parse_size, default=parse_size("64MiB"), help="default 64MiB")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per method (default 5)")
    parser.add_argument("--modes", default=",".join(PRODUCE_MODES), help=f"comma list of {', '.join(PRODUCE_MODES)}")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of every worker call, seconds")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output directory")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(PRODUCE_MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(PRODUCE_MODES)}")
    started = time.time()
    results = run(args.size, args.bucket_size, args.reps, modes, args.out, args.timeout)
    print(report(results))
    print(f"wrote {args.out / 'produce.json'} and {args.out / 'produce.md'} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
