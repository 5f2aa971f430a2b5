"""``python -m benchmarks.gpu``: the GPU section, for a machine with one CUDA device.

* device-to-device copy bandwidth: ``copy_`` between two preallocated device buffers (the limit a
  same-GPU refit can approach);
* NCCL self-test: broadcast and all-reduce of a 1 GiB buffer in a one-rank NCCL group (one GPU
  cannot host two ranks of one communicator), reported as algorithm and bus bandwidth with the
  nccl-tests formulas: with one rank, broadcast's bus bandwidth equals its algorithm bandwidth
  and all-reduce's is 0 (nothing crosses a bus), so it mostly shows that NCCL works here;
* the cuda_ipc engine with ``device="cuda"``: one policy process and one rollout process on the
  same GPU, a 1 GiB transformer-shaped payload generated on the GPU, per bucket size, end to end
  (the warm-up refit is checked bit-exact), as a ratio to the copy bandwidth.

Prints a Markdown table, and with fewer than two GPUs a line saying what could not be measured
(NCCL between GPUs); ``--json PATH`` also writes every figure. Without CUDA it prints one line
and exits 0. Exits 1 when a measurement failed (each failure is in the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt_core.bench.synthetic import transformer_shapes

from .harness import Phase, run_phase, stderr_log
from .methods import RefitMethod, describe_error
from .report import summarize_case
from .units import format_size, parse_size, parse_sizes
from .weights import Payload


def _median_seconds(operation: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median wall time of ``operation`` after one warm-up; on a GPU, between CUDA events."""
    operation()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            operation()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            operation()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure_copy(nbytes: int, device: torch.device, reps: int) -> dict[str, Any]:
    """``copy_`` of ``nbytes`` between two preallocated, touched buffers on ``device``."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    try:
        seconds = _median_seconds(lambda: target.copy_(source), device, reps)
    finally:
        source = target = torch.empty(0)  # drop the buffers before emptying the cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "name": f"device-to-device copy_ ({format_size(nbytes)})",
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
        "note": "bytes copied per second (each byte is read once and written once)",
    }


def measure_nccl_self_test(nbytes: int, device: torch.device, reps: int) -> list[dict[str, Any]]:
    """One-rank NCCL broadcast and all-reduce of ``nbytes`` (float32), on a group built on a
    private store: the default process group is never created."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise RuntimeError("this torch build has no NCCL (torch.distributed.is_nccl_available() is False)")
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=120)
    group = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, options)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    rows = []
    try:
        with torch.cuda.device(device):
            for name, run_op, bus_factor in (
                # torch's stubs leave these out of ProcessGroupNCCL; the bindings have them
                ("broadcast", lambda: group.broadcast(buffer, 0).wait(), 1.0),  # type: ignore[attr-defined]
                ("all-reduce", lambda: group.allreduce(buffer).wait(), 0.0),  # type: ignore[attr-defined]  # 2(n-1)/n, n = 1
            ):
                seconds = _median_seconds(run_op, device, reps)
                algbw = buffer.numel() * 4 / seconds / 1e9
                rows.append(
                    {
                        "name": f"NCCL {name}, 1 rank ({format_size(nbytes)})",
                        "seconds": seconds,
                        "gbps": algbw,
                        "busbw_gbps": algbw * bus_factor,
                        "note": f"algbw; busbw {algbw * bus_factor:.1f} GB/s (nccl-tests formula, 1 rank)",
                    }
                )
    finally:
        buffer = torch.empty(0)  # release the payload before the group goes
        for stop in ("shutdown", "abort"):
            try:
                getattr(group, stop)()
                break
            except Exception:  # noqa: BLE001 - best effort at the end of a measurement
                continue
        torch.cuda.empty_cache()
    return rows


def device_payload(size_bytes: int, device: str) -> Payload:
    """The transformer-shaped payload of ``size_bytes``, generated on ``device`` in the sender."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in transformer_shapes(size_bytes)]
    return Payload(
        label=format_size(size_bytes),
        payload_bytes=sum(sizes),
        tensors=len(sizes),
        largest_tensor_bytes=max(sizes),
        weights="benchmarks.weights:device_weights",
        weights_params={"size_bytes": size_bytes, "device": device},
    )


def measure_cuda_ipc(
    payload: Payload, buckets: Sequence[int], device: str, reps: int, timeout_s: float
) -> list[dict[str, Any]]:
    """cuda_ipc refits, 1 policy -> 1 rollout process, one row per bucket size."""
    methods = [
        RefitMethod(
            key=f"ipc_{bucket}",
            label=f"cuda_ipc device={device} 1->1, bucket {format_size(bucket)}",
            backend="cuda_ipc",
            num_rollout=1,
            bucket_size=bucket,
            engine_kwargs={"device": device},
            topology="broadcast",
            timeout_s=timeout_s,
        )
        for bucket in buckets
    ]
    try:
        records = run_phase(Phase("gpu", methods, [payload], reps), stderr_log(time.monotonic()))
    finally:
        for method in methods:
            method.close()
    rows = []
    for record in records:
        case = summarize_case(record)
        rows.append(
            {
                "name": case["label"],
                "seconds": case["median_seconds"],
                "gbps": case["gbps"],
                "error": case["error"],
                "stats": case["stats"],
                "note": f"{payload.label} payload ({payload.tensors} tensors), end to end",
            }
        )
    return rows


def render(rows: list[dict[str, Any]], copy_gbps: float | None, header: str) -> str:
    lines = [header, "", "| measurement | GB/s | x copy_ | note |", "| --- | --- | --- | --- |"]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['name']} | failed | | {row['error'].splitlines()[0][:200]} |")
            continue
        ratio = f"{row['gbps'] / copy_gbps:.2f}x" if copy_gbps and row["gbps"] else ""
        lines.append(f"| {row['name']} | {row['gbps']:.1f} | {ratio} | {row.get('note', '')} |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30, help="payload and buffer size (default 1GiB)")
    parser.add_argument(
        "--buckets",
        type=parse_sizes,
        default=[64 << 20, 256 << 20],
        help="cuda_ipc bucket sizes (default 64MiB,256MiB)",
    )
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (default 5)")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of every worker call, seconds")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: skipped, no CUDA device is visible (torch.cuda.is_available() is False)")
        return 0
    if args.reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {args.reps}")
    device = torch.device("cuda", torch.cuda.current_device())
    rows: list[dict[str, Any]] = []
    copy_gbps = None
    for name, measure in (
        ("device-to-device copy_", lambda: [measure_copy(args.size, device, args.reps)]),
        ("NCCL self-test", lambda: measure_nccl_self_test(args.size, device, args.reps)),
    ):
        try:
            rows += measure()
        except Exception as exc:  # noqa: BLE001 - one failed measurement must not hide the others
            rows.append({"name": name, "gbps": None, "error": describe_error(exc)})
    if rows and not rows[0].get("error"):
        copy_gbps = rows[0]["gbps"]
    rows += measure_cuda_ipc(device_payload(args.size, "cuda"), args.buckets, "cuda", args.reps, args.timeout)
    header = (
        f"GPU benchmarks on {torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}); medians of {args.reps} after a warm-up"
    )
    print(render(rows, copy_gbps, header))
    if torch.cuda.device_count() < 2:
        print(
            f"Not measured here: NCCL between ranks on two GPUs, so no nccl refit "
            f"({torch.cuda.device_count()} GPU visible; the one-rank self-test above moves nothing between GPUs)."
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "copy_gbps": copy_gbps, "rows": rows}, indent=1) + "\n")
    return 1 if any(row.get("error") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
