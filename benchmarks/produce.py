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
* the ready-weights refit of the same payload, for reference;
* the raw transfer and the ready-weights refit again, each while another process produces the
  weights over and over (:class:`~benchmarks.methods.BesideProducing`): what each transfer
  manages when producing takes its share of the machine, as inside the refit.

It reports medians and the ratios the performance issue sets: refit speed-up over the naive
loop (minimum 2x), refit time over produce + raw (at most 0.85x) and over max(produce, raw)
(goal 1.2x: production hidden). It also reports where the refit's time went
(:func:`~benchmarks.methods.refit_phases`: producing, the sender blocked on the transport, and
the bytes still moving after its last post), and what the machine allows
(:func:`refit_floors`: the soonest the producer's thread, and the refit's CPU time on these
cores, let a refit end). Writes ``produce.json`` and ``produce.md`` into ``--out``.
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

from .methods import BesideProducing, FloorMethod, Method, NaiveLoopMethod, ProduceMethod, RefitMethod
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

    from ckpt_core.tensors import dtype_from_name

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
        "cores": os.cpu_count() or 1,
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
                BesideProducing(
                    FloorMethod(key="raw", label="raw", topology="paired", num_receivers=1, timeout_s=timeout_s),
                    key="raw_beside_producing",
                    label="raw Gloo send/recv of the produced bytes, beside producing",
                    threads=producer_threads,
                ),
                NaiveLoopMethod(
                    key="naive", label="naive produce-then-send loop", layout=producer, timeout_s=timeout_s
                ),
                _gloo_paired_refit("refit_ready", "gloo_cpu paired refit, ready weights", bucket_size, timeout_s),
                BesideProducing(
                    _gloo_paired_refit("refit_ready", "refit_ready", bucket_size, timeout_s),
                    key="refit_ready_beside_producing",
                    label="gloo_cpu paired refit of ready weights, beside producing",
                    threads=producer_threads,
                ),
            ]
            beside = [m for m in methods if isinstance(m, BesideProducing)]
            ready_keys = {"refit_ready", "refit_ready_beside_producing"}
            payload = produced(ready, mode)
            seconds: dict[str, list[float]] = {m.key: [] for m in methods}
            phases: dict[str, list[float]] = {}
            refit_cpu: dict[str, list[float]] = {}
            try:
                for method in methods:
                    method.open()
                refit = methods[2]
                assert isinstance(refit, RefitMethod)
                refit.record_bucket_posts()
                producer.warm_up(payload)
                payload = _with_size(payload, producer.layout)
                for method in beside:
                    method.producing = payload
                for method in methods[1:]:
                    method.warm_up(ready if method.key in ready_keys else payload)
                for _ in range(reps):
                    for method in methods:
                        sample = method.sample(ready if method.key in ready_keys else payload)
                        seconds[method.key].append(sample.seconds)
                        if method is refit:
                            for worker in sample.workers:
                                refit_cpu.setdefault(worker.role, []).append(worker.cpu_seconds)
                            for phase, value in (sample.phases or {}).items():
                                phases.setdefault(phase, []).append(value)
            finally:
                for method in methods:
                    method.close()
            median = {key: statistics.median(values) for key, values in seconds.items()}
            median_phases = {key: statistics.median(values) for key, values in phases.items()}
            median_cpu = {role: statistics.median(values) for role, values in refit_cpu.items()}
            floors = refit_floors(median, median_phases, median_cpu, results["cores"])
            results["modes"][mode] = {
                "payload_bytes": payload.payload_bytes,
                "ready_payload_bytes": ready.payload_bytes,
                "tensors": payload.tensors,
                "seconds": seconds,
                "median_seconds": median,
                "gbps": {
                    k: (ready.payload_bytes if k in ready_keys else payload.payload_bytes) / v / 1e9
                    for k, v in median.items()
                },  # fmt: skip
                "refit_phases_seconds": phases,
                "median_refit_phases_seconds": median_phases,
                # about the soonest a refit can end: nothing moves before the first post, then
                # every byte at the rate the transfer has beside producing (an estimate: the
                # last bytes, once producing ends, move faster)
                "first_post_plus_raw_beside_producing": median_phases["first_post"] + median["raw_beside_producing"],
                "first_post_plus_ready_refit_beside_producing": (
                    median_phases["first_post"] + median["refit_ready_beside_producing"]
                ),
                "refit_cpu_seconds": refit_cpu,
                "median_refit_cpu_seconds": median_cpu,
                "floor_seconds": floors,
                "over_floor": median["refit"] / max(floors.values()),
                "speedup_over_naive": median["naive"] / median["refit"],
                "over_produce_plus_raw": median["refit"] / (median["produce"] + median["raw"]),
                "over_max_produce_raw": median["refit"] / max(median["produce"], median["raw"]),
            }
    out.mkdir(parents=True, exist_ok=True)
    (out / "produce.json").write_text(json.dumps(results, indent=2))
    (out / "produce.md").write_text(report(results))
    return results


def refit_floors(
    median: dict[str, float], phases: dict[str, float], cpu: dict[str, float], cores: int
) -> dict[str, float]:
    """Two lower bounds on a produced refit's time on this machine, from the same run's medians
    (seconds):

    * ``producer_thread``: producing alone (with the policy process's threads) plus the refit's
      time after its last post. Producing cannot go faster inside the refit than alone, and the
      last bucket's bytes cannot move before they are made.
    * ``cpu``: the CPU time of the refit's processes (``cpu``: seconds by role), spread over
      ``cores``, except before the first post, when only the producer has work.
    """
    head = phases["first_post"]
    return {
        "producer_thread": median["produce"] + phases["after_last_post"],
        "cpu": head + max(0.0, sum(cpu.values()) - head) / cores,
    }


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
        "Where the refit's time went (medians, seconds; they need not add up to the refit's median):",
        "",
        "| mode | refit | producing | (alone) | of it, before the first post | sender blocked | after the last post "
        "| raw transfer, beside producing | ready-weights refit, beside producing | first post + raw | "
        "first post + ready refit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in results["modes"].items():
        p, m = r["median_refit_phases_seconds"], r["median_seconds"]
        lines.append(
            f"| {mode} | {m['refit']:.3f} | {p['producing']:.3f} | {m['produce']:.3f} | {p['first_post']:.3f} "
            f"| {p['blocked']:.3f} | {p['after_last_post']:.3f} | {m['raw_beside_producing']:.3f} "
            f"| {m['refit_ready_beside_producing']:.3f} | {r['first_post_plus_raw_beside_producing']:.3f} "
            f"| {r['first_post_plus_ready_refit_beside_producing']:.3f} |"
        )
    lines += [
        "",
        "producing: the sender in its weights' generator and packing, up to its last bucket post;",
        "blocked: the sender waiting for a slot before that; after the last post: bytes still moving",
        "once everything is produced (producing + blocked + after the last post = the refit).",
        "Beside producing: measured while another process produces the weights over and over, as",
        "the refit's own producer does beside its transfer. Nothing moves before the first post, so",
        "first post + a transfer beside producing is about the soonest that transfer lets a refit end.",
        "",
        f"What {results['cores']} cores allow (medians, seconds):",
        "",
        "| mode | refit | CPU, sender | CPU, receiver | floor: produce alone + after the last post "
        "| floor: CPU over the cores | refit / larger floor | naive loop / larger floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in results["modes"].items():
        m, cpu, floors = r["median_seconds"], r["median_refit_cpu_seconds"], r["floor_seconds"]
        lines.append(
            f"| {mode} | {m['refit']:.3f} | {cpu['sender']:.3f} | {cpu['receiver']:.3f} "
            f"| {floors['producer_thread']:.3f} | {floors['cpu']:.3f} | {r['over_floor']:.2f}x "
            f"| {m['naive'] / max(floors.values()):.2f}x |"
        )
    lines += [
        "",
        "The producer is one thread: no refit ends before producing alone plus moving what is made",
        "last. Nor before the refit's CPU time fits on the cores (only the producer works before the",
        "first post). x naive >= 2 needs the naive loop at 2x the larger floor or more.",
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
