"""``python -m benchmarks.run``: ckpt-engine refits beside the transport floor, the memory limit
and the naive refit, in one run, round-robin.

Phases, one per bucket size: the refit methods of that bucket size (fresh processes), measured
round-robin with the baselines (processes kept for the whole run) on every payload; then the
per-tensor overhead phase. Every process is reused across payloads and repetitions, and payloads
are mapped from tmpfs, so one run fits a small machine. ``--quick``: 256 MiB, 64 MiB buckets,
3 repetitions, results under ``benchmarks/results/tmp/quick``.

Writes ``benchmarks.json``, ``benchmarks.md`` and ``throughput.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt_core.rss import reset_peak_rss

from .harness import CaseRecord, Phase, run_phase, stderr_log
from .methods import FloorMethod, MemcpyMethod, Method, NaiveMethod, RefitMethod
from .per_tensor_floor import view_floor_seconds
from .report import (
    PER_TENSOR_GROUP,
    SCHEMA,
    add_ratios,
    evaluate_targets,
    per_tensor_summary,
    render_markdown,
    summarize_case,
)
from .units import format_size, parse_size, parse_sizes
from .weights import Payload, small_payload, write_payload

RESULTS = Path(__file__).resolve().parent / "results"
BUCKET_METHODS = (
    "gloo_paired",
    "gloo_paired_checksum",
    "gloo_broadcast",
    "ipc_1to1",
    "ipc_1to1_borrowed",
    "ipc_1to2",
    "raw_paired_pieces",
)
# Asked for by name only: with it, the 1 GiB phases' worker processes (and their pools of freed
# tensor memory) outgrew 24 GiB once, and the kernel killed a rollout.
OPT_IN_METHODS = ("ipc_1to1_borrowed",)
BASELINE_METHODS = (
    "raw_paired",
    "raw_broadcast",
    "memcpy",
    "memcpy_2proc",
    "memcpy_3proc",
    "naive_torch_1to1",
    "naive_torch_1to2",
    "naive_safetensors_1to1",
)
ALL_METHODS = BUCKET_METHODS + BASELINE_METHODS + ("per_tensor",)
PER_TENSOR_BUCKET = 64 << 20

MEMORY_METHOD = (
    "Every worker records its resident set size (VmRSS) when it is constructed, before any buffer or "
    "weight exists (*base*), resets its peak (writing 5 to /proc/self/clear_refs) right before each "
    "measured call, and reads the peak since then (VmHWM) after it. So processes are reused across "
    "cases, yet every figure is the peak of that one call, not of the process's life. *Sender MiB "
    "over weights* = peak - base - payload bytes (the sender's weights are mapped from tmpfs and fully "
    "touched, so they count in its RSS); *receiver MiB over payload* = peak - base - payload bytes "
    "(a receiver holds every tensor it received until the refit ends). Both include the two bucket "
    "buffers, allocator slack, and libraries loaded after construction. Figures are the maximum over "
    "the timed repetitions and over the processes of that role."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB payload, 64 MiB buckets, 3 repetitions")
    parser.add_argument("--payloads", type=parse_sizes, default=None, help="comma list (default 256MiB,1GiB)")
    parser.add_argument("--buckets", type=parse_sizes, default=None, help="comma list (default 16MiB,64MiB,256MiB)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 5)")
    parser.add_argument(
        "--methods",
        default=",".join(m for m in ALL_METHODS if m not in OPT_IN_METHODS),
        help=f"comma list of: {', '.join(ALL_METHODS)} (default all but {', '.join(OPT_IN_METHODS)})",
    )
    parser.add_argument("--per-tensor-count", type=int, default=20000, help="tensors in the overhead case")
    parser.add_argument("--per-tensor-bytes", type=parse_size, default=4096, help="bytes per tensor (default 4096)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline of every worker call, seconds")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default benchmarks/results, or results/tmp/quick with --quick)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser


def _config(args: argparse.Namespace) -> dict[str, Any]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(ALL_METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(ALL_METHODS)}")
    payloads = args.payloads or ([256 << 20] if args.quick else [256 << 20, 1 << 30])
    buckets = args.buckets or ([64 << 20] if args.quick else [16 << 20, 64 << 20, 256 << 20])
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    if reps < 1:
        raise SystemExit(f"--reps must be >= 1, got {reps}")
    if args.per_tensor_count < 0 or args.per_tensor_bytes < 4 or args.per_tensor_bytes % 4:
        raise SystemExit("--per-tensor-count must be >= 0 and --per-tensor-bytes a positive multiple of 4")
    out = args.out or (RESULTS / "tmp" / "quick" if args.quick else RESULTS)
    return {
        "quick": bool(args.quick),
        "payload_sizes": payloads,
        "bucket_sizes": buckets,
        "reps": reps,
        "methods": methods,
        "per_tensor_count": args.per_tensor_count if "per_tensor" in methods else 0,
        "per_tensor_bytes": args.per_tensor_bytes,
        "timeout_s": args.timeout,
        "out": str(out),
        "plot": not args.no_plot,
    }


def _scratch_dir() -> Path:
    """A private directory on tmpfs (``/dev/shm`` where it exists): payloads and naive files."""
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=base))


def _bucket_methods(bucket: int, selected: Sequence[str], timeout_s: float) -> list[Method]:
    made: dict[str, Method] = {
        "gloo_paired": RefitMethod(
            key="gloo_paired",
            label="gloo_cpu paired",
            backend="gloo_cpu",
            num_rollout=1,
            bucket_size=bucket,
            engine_kwargs={"topology": "paired"},
            topology="paired",
            timeout_s=timeout_s,
        ),
        "gloo_paired_checksum": RefitMethod(
            key="gloo_paired_checksum",
            label="gloo_cpu paired, checksum=True",
            backend="gloo_cpu",
            num_rollout=1,
            bucket_size=bucket,
            engine_kwargs={"topology": "paired", "checksum": True},
            topology="paired",
            timeout_s=timeout_s,
        ),
        "gloo_broadcast": RefitMethod(
            key="gloo_broadcast",
            label="gloo_cpu broadcast",
            backend="gloo_cpu",
            num_rollout=2,
            bucket_size=bucket,
            engine_kwargs={"topology": "broadcast"},
            topology="broadcast",
            timeout_s=timeout_s,
        ),
        "ipc_1to1": RefitMethod(
            key="ipc_1to1",
            label="cuda_ipc device=cpu",
            backend="cuda_ipc",
            num_rollout=1,
            bucket_size=bucket,
            engine_kwargs={"device": "cpu"},
            topology="broadcast",
            timeout_s=timeout_s,
        ),
        "ipc_1to1_borrowed": RefitMethod(
            key="ipc_1to1_borrowed",
            label="cuda_ipc device=cpu, borrow_received_tensors",
            backend="cuda_ipc",
            num_rollout=1,
            bucket_size=bucket,
            engine_kwargs={"device": "cpu", "borrow_received_tensors": True},
            topology="broadcast",
            timeout_s=timeout_s,
        ),
        "ipc_1to2": RefitMethod(
            key="ipc_1to2",
            label="cuda_ipc device=cpu",
            backend="cuda_ipc",
            num_rollout=2,
            bucket_size=bucket,
            engine_kwargs={"device": "cpu"},
            topology="broadcast",
            timeout_s=timeout_s,
        ),
        "raw_paired_pieces": FloorMethod(
            key="raw_paired_pieces",
            label="raw Gloo send/recv in bucket pieces",
            topology="paired",
            num_receivers=1,
            piece_bytes=bucket,
            timeout_s=timeout_s,
        ),
    }
    return [made[k] for k in BUCKET_METHODS if k in selected]


def _baseline_methods(selected: Sequence[str], scratch: Path, timeout_s: float) -> dict[str, Method]:
    made: dict[str, Method] = {
        "raw_paired": FloorMethod(
            key="raw_paired",
            label="raw Gloo send/recv (floor)",
            topology="paired",
            num_receivers=1,
            timeout_s=timeout_s,
        ),
        "raw_broadcast": FloorMethod(
            key="raw_broadcast",
            label="raw Gloo broadcast (floor)",
            topology="broadcast",
            num_receivers=2,
            timeout_s=timeout_s,
        ),
        "memcpy": MemcpyMethod(timeout_s=timeout_s),
        "memcpy_2proc": MemcpyMethod(processes=2, timeout_s=timeout_s),
        "memcpy_3proc": MemcpyMethod(processes=3, timeout_s=timeout_s),
        "naive_torch_1to1": NaiveMethod(
            key="naive_torch_1to1",
            label="naive torch.save -> torch.load",
            fmt="torch",
            num_receivers=1,
            scratch=scratch,
            timeout_s=timeout_s,
        ),
        "naive_torch_1to2": NaiveMethod(
            key="naive_torch_1to2",
            label="naive torch.save -> torch.load",
            fmt="torch",
            num_receivers=2,
            scratch=scratch,
            timeout_s=timeout_s,
        ),
        "naive_safetensors_1to1": NaiveMethod(
            key="naive_safetensors_1to1",
            label="naive safetensors save_file -> load_file + clone",
            fmt="safetensors",
            num_receivers=1,
            scratch=scratch,
            timeout_s=timeout_s,
        ),
    }
    return {k: made[k] for k in BASELINE_METHODS if k in selected}


def _environment() -> dict[str, Any]:
    memory_kib = 0
    try:
        with open("/proc/meminfo") as meminfo:
            memory_kib = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
    except (OSError, StopIteration):
        pass
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                cwd=Path(__file__).resolve().parent,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gib": memory_kib / (1 << 20),
        "torch_threads": torch.get_num_threads(),
        "git_commit": commit,
        "peak_reset_supported": reset_peak_rss(),
        "load_before": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def run(config: dict[str, Any]) -> dict[str, Any]:
    """Run every phase of ``config`` (see :func:`_config`) and return the results document."""
    started = time.monotonic()
    log = stderr_log(started)
    environment = _environment()
    scratch = _scratch_dir()
    records: list[CaseRecord] = []
    per_tensor_floor: float | None = None
    baselines: dict[str, Method] = {}
    payloads: list[Payload] = []
    try:
        for size in config["payload_sizes"]:
            label = format_size(size)
            payloads.append(write_payload(scratch / f"payload-{size}", size, label=label))
            log(f"wrote the {label} payload ({payloads[-1].tensors} tensors) to {scratch}")
        baselines = _baseline_methods(config["methods"], scratch, config["timeout_s"])
        for bucket in config["bucket_sizes"]:
            methods = _bucket_methods(bucket, config["methods"], config["timeout_s"])
            phase = Phase(f"bucket {format_size(bucket)}", methods + list(baselines.values()), payloads, config["reps"])
            try:
                if phase.methods:
                    records += run_phase(phase, log)
            finally:
                for method in methods:
                    method.close()
        for method in [m for k, m in baselines.items() if k != "raw_paired"]:
            method.close()
        if config["per_tensor_count"]:
            small = small_payload(config["per_tensor_count"], config["per_tensor_bytes"])
            refit = _bucket_methods(PER_TENSOR_BUCKET, ["gloo_paired"], config["timeout_s"])
            refit.append(
                RefitMethod(
                    key="gloo_paired_borrowed",
                    label="gloo_cpu paired, borrow_received_tensors",
                    backend="gloo_cpu",
                    num_rollout=1,
                    bucket_size=PER_TENSOR_BUCKET,
                    engine_kwargs={"topology": "paired", "borrow_received_tensors": True},
                    topology="paired",
                    timeout_s=config["timeout_s"],
                )
            )
            per_tensor_floor = view_floor_seconds(
                config["per_tensor_count"], config["per_tensor_bytes"], max(3, config["reps"])
            )
            floor = [
                baselines.get("raw_paired")
                or FloorMethod(
                    key="raw_paired",
                    label="raw Gloo send/recv (floor)",
                    topology="paired",
                    num_receivers=1,
                    timeout_s=config["timeout_s"],
                )
            ]
            try:
                records += run_phase(Phase(PER_TENSOR_GROUP, refit + floor, [small], config["reps"]), log)
            finally:
                for method in refit + floor:
                    method.close()
    finally:
        for method in baselines.values():
            method.close()
        shutil.rmtree(scratch, ignore_errors=True)
    environment["load_after"] = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    environment["wall_seconds"] = time.monotonic() - started
    cases = [summarize_case(r) for r in records]
    add_ratios(cases)
    largest = {p.label: p.largest_tensor_bytes for p in payloads}
    return {
        "schema": SCHEMA,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "environment": environment,
        "config": config,
        "memory_method": MEMORY_METHOD,
        "payloads": [{k: v for k, v in p.to_dict().items() if k != "weights_params"} for p in payloads],
        "cases": cases,
        "targets": evaluate_targets(cases, largest),
        "per_tensor": per_tensor_summary(cases, per_tensor_floor),
    }


def write_results(doc: dict[str, Any], out: Path, *, plot: bool) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "benchmarks.json", out / "benchmarks.md"]
    written[0].write_text(json.dumps(doc, indent=1) + "\n")
    written[1].write_text(render_markdown(doc))
    if plot:
        from .plot import plot_throughput

        plot_throughput(doc, out / "throughput.png")
        written.append(out / "throughput.png")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    config = _config(_parser().parse_args(argv))
    doc = run(config)
    written = write_results(doc, Path(config["out"]), plot=config["plot"])
    print(render_markdown(doc))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
