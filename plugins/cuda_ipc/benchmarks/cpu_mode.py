"""CPU-mode throughput of cuda_ipc beside gloo_cpu and a plain memcpy, measured in one run.

    python plugins/cuda_ipc/benchmarks/cpu_mode.py [--size 1GiB] [--bucket 64MiB] [--refits 3]

Each refit moves a transformer-shaped state dict from one policy process to one and to two
rollout processes (every tensor checked bit-exact by digest), after one warm-up refit, with
checksums on (each backend's default) and off. The
memcpy line is one thread copying the same number of bytes into warm (already faulted) memory.
Only ratios within one run mean anything on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ckpt_core.bench import BenchConfig, run_bench


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def memcpy_gbps(nbytes: int, repetitions: int) -> float:
    """Median GB/s of one thread copying ``nbytes`` between two warm buffers."""
    torch.set_num_threads(1)
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.zeros(nbytes, dtype=torch.uint8)
    target.copy_(source)  # fault every page in first
    seconds = []
    for _ in range(repetitions):
        start = time.perf_counter()
        target.copy_(source)
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--bucket", default="64MiB")
    parser.add_argument("--refits", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    size, bucket = parse_size(args.size), parse_size(args.bucket)

    rows: dict[str, object] = {"size_bytes": size, "bucket_size": bucket}
    rows["memcpy_gbps"] = memcpy_gbps(size, 5)
    variants = (
        ("cuda_ipc", {"device": "cpu"}),
        ("cuda_ipc_nochecksum", {"device": "cpu", "checksum": False}),
        ("gloo_cpu", {}),
        ("gloo_cpu_nochecksum", {"checksum": False}),
    )
    for label, options in variants:
        backend = label.split("_nochecksum")[0]
        for rollouts in (1, 2):
            config = BenchConfig(
                backend=backend,
                size_bytes=size,
                bucket_size=bucket,
                num_policy=1,
                num_rollout=rollouts,
                refits=args.refits,
                engine_kwargs=dict(options),
                baseline=False,
            )
            result = run_bench(config)
            rows[f"{label}_1to{rollouts}"] = {
                "gbps": result["gbps"],
                "policy": {k: result["policy"][0][k] for k in ("seconds", "pack_seconds", "transfer_seconds", "checksum_seconds")},
                "rollout": [
                    {k: r[k] for k in ("seconds", "transfer_seconds", "unpack_seconds", "checksum_seconds")}
                    for r in result["rollout"]
                ],
            }
            print(f"{label} 1->{rollouts}: {result['gbps']:.2f} GB/s", flush=True)
    rows["memcpy_gbps_after"] = memcpy_gbps(size, 5)
    print(f"memcpy (1 thread, warm): {rows['memcpy_gbps']:.2f} GB/s before, {rows['memcpy_gbps_after']:.2f} after")
    memcpy = statistics.mean([rows["memcpy_gbps"], rows["memcpy_gbps_after"]])  # type: ignore[list-item]
    for suffix in ("", "_nochecksum"):
        for rollouts in (1, 2):
            ipc = rows[f"cuda_ipc{suffix}_1to{rollouts}"]["gbps"]  # type: ignore[index]
            gloo = rows[f"gloo_cpu{suffix}_1to{rollouts}"]["gbps"]  # type: ignore[index]
            print(
                f"1->{rollouts}{suffix or ' (checksums on)'}: cuda_ipc / gloo_cpu = {ipc / gloo:.2f}x, "
                f"cuda_ipc / memcpy = {ipc / memcpy:.2f}x"
            )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
