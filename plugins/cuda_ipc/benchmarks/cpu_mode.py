"""CPU-mode throughput of cuda_ipc beside gloo_cpu and a plain memcpy, measured in one run.

    python plugins/cuda_ipc/benchmarks/cpu_mode.py [--size 1GiB] [--bucket 64MiB] [--rounds 3]
        [--checksum on|off|both] [--rollouts 1 2] [--json out.json]

One policy process sends a transformer-shaped state dict to one, then to two rollout
processes (every tensor checked bit-exact by digest), with checksums on and off (both
backends default to off). The backends' worker pools are up at the same time and their refits
alternate, round by round, with a one-thread memcpy of the same bytes into warm memory in
between, so a shared machine's changing load falls on all of them alike. Reported: median
GB/s per backend (payload bytes over the slowest rollout's refit time) and the median of the
per-round ratios.

On a loaded machine wall time mostly measures how much CPU the scheduler gave each process,
so every worker also reports the CPU time (user + system, all threads) its process spent in
the transfer (not in the verification digests): ``cpu_bound_gbps`` is the payload over the
larger of the busiest process's CPU seconds and all workers' CPU seconds spread over this
machine's cores, the throughput an idle machine of this size would allow. The memcpy line
has the same figure from its CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

import torch

from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


class Memcpy:
    """One thread copying ``nbytes`` between two warm buffers."""

    def __init__(self, nbytes: int) -> None:
        torch.set_num_threads(1)
        self.source = torch.ones(nbytes, dtype=torch.uint8)
        self.target = torch.zeros(nbytes, dtype=torch.uint8)
        self.target.copy_(self.source)  # fault every page in first

    def measure(self) -> dict[str, float]:
        start, cpu = time.perf_counter(), time.process_time()
        self.target.copy_(self.source)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        nbytes = self.source.numel()
        return {"gbps": nbytes / wall / 1e9, "cpu_bound_gbps": nbytes / cpu / 1e9}


def refit_gbps(coordinator: RefitCoordinator) -> dict[str, Any]:
    report = coordinator.refit()
    cpu = [r["transfer_cpu_seconds"] for r in report.policy[:1] + report.rollout]
    slowest = max(report.rollout, key=lambda r: r["stats"]["seconds"])["stats"]
    policy = report.policy[0]["stats"]
    critical = max(max(cpu), sum(cpu) / (os.cpu_count() or 1))
    return {
        "gbps": slowest["payload_bytes"] / slowest["seconds"] / 1e9,
        "cpu_seconds": cpu,
        "cpu_bound_gbps": slowest["payload_bytes"] / critical / 1e9,
        "policy": {k: policy[k] for k in ("seconds", "pack_seconds", "transfer_seconds", "checksum_seconds")},
        "rollout": {k: slowest[k] for k in ("seconds", "transfer_seconds", "unpack_seconds", "checksum_seconds")},
    }


def measure(size: int, bucket: int, rollouts: int, checksum: bool, rounds: int, memcpy: Memcpy) -> dict[str, Any]:
    backends: dict[str, dict[str, Any]] = {
        "cuda_ipc": {"device": "cpu", "checksum": checksum},
        "gloo_cpu": {"checksum": checksum},
    }
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    with contextlib.ExitStack() as stack:
        coordinators = {}
        for backend, options in backends.items():
            specs, labels = refit_worker_specs(
                backend=backend,
                num_policy=1,
                num_rollout=rollouts,
                bucket_size=bucket,
                engine_kwargs=options,
                weights="ckpt_core.bench.synthetic:transformer_weights",
                weights_params={"size_bytes": size},
            )
            for spec in specs:
                spec["service"] = "cpu_timed_worker:CpuTimedWorker"
            pool = stack.enter_context(LocalProcessPool(specs, labels=labels, env=env))
            coordinator = RefitCoordinator(pool, num_policy=1, num_rollout=rollouts, timeout_s=900)
            coordinator.setup()
            stack.callback(coordinator.finalize)
            coordinator.refit()  # warm-up: materializes the weights, faults the buffers in
            coordinators[backend] = coordinator
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in [*backends, "memcpy"]}
        for _ in range(rounds):
            for backend, coordinator in coordinators.items():
                runs[backend].append(refit_gbps(coordinator))
            runs["memcpy"].append(memcpy.measure())
    result: dict[str, Any] = {"runs": runs}
    for figure in ("gbps", "cpu_bound_gbps"):
        ipc, gloo, copy = ([r[figure] for r in runs[name]] for name in ("cuda_ipc", "gloo_cpu", "memcpy"))
        result[figure] = {
            "median": {name: statistics.median(r[figure] for r in rows) for name, rows in runs.items()},
            "cuda_ipc_over_gloo_cpu": statistics.median(a / b for a, b in zip(ipc, gloo)),
            "cuda_ipc_over_memcpy": statistics.median(a / b for a, b in zip(ipc, copy)),
            "gloo_cpu_over_memcpy": statistics.median(a / b for a, b in zip(gloo, copy)),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--bucket", default="64MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checksum", choices=("on", "off", "both"), default="both")
    parser.add_argument("--rollouts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    size, bucket = parse_size(args.size), parse_size(args.bucket)
    memcpy = Memcpy(size)
    results: dict[str, Any] = {"size_bytes": size, "bucket_size": bucket}
    for checksum in {"on": (True,), "off": (False,), "both": (True, False)}[args.checksum]:
        for rollouts in args.rollouts:
            key = f"1to{rollouts}_checksum_{'on' if checksum else 'off'}"
            result = measure(size, bucket, rollouts, checksum, args.rounds, memcpy)
            results[key] = result
            for figure in ("gbps", "cpu_bound_gbps"):
                row = result[figure]
                gbps = row["median"]
                print(
                    f"{key} {figure}: cuda_ipc {gbps['cuda_ipc']:.2f}, gloo_cpu {gbps['gloo_cpu']:.2f}, "
                    f"memcpy {gbps['memcpy']:.2f} | cuda_ipc/gloo_cpu {row['cuda_ipc_over_gloo_cpu']:.2f}x, "
                    f"cuda_ipc/memcpy {row['cuda_ipc_over_memcpy']:.2f}x",
                    flush=True,
                )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
