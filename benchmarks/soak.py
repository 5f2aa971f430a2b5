"""``python -m benchmarks.soak``: hundreds of refits in a row, watching for leaks.

Refit runs after every training step for days, so a leak of one bucket's memory, one file
descriptor or one shared-memory segment per refit ends a job sooner or later. This runs
``--refits`` refits (default 200) through gloo_cpu, 1 policy -> 1 rollout process, every one
checked bit-exact by the coordinator, and samples from outside each worker process, after
every refit: resident memory (``VmRSS``), open descriptors (``/proc/<pid>/fd``), the
``/dev/shm`` files it maps or holds, and the entries in ``/dev/shm``.

Pass criteria, from refit ``--settle`` (default 10: allocator pools and lazily mapped pages
have reached their steady state by then) to the last: each process's RSS grows by less than
one bucket, its descriptor count does not change, and no ``/dev/shm`` entry appears.

Writes ``benchmarks/results/soak.json`` (or ``--out``) and prints a summary for the README.
The suite runs a short version (``tests/reliability/test_rel_soak.py``) through
:func:`run_soak`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from ckpt_core.cli import parse_size
from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import refit_worker_specs

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
SHM_PREFIXES = ("torch_", "psm_", "sem.", "mp-", "ckpt-cuda-ipc", "cuda_ipc")
"""Names Python's multiprocessing, torch or a ckpt transport would give a /dev/shm entry. Other
programs on a shared machine create entries of their own meanwhile; those are reported, not
counted against this run."""

# --- the payload ------------------------------------------------------------------------------

_CACHE: dict[str, list[tuple[str, torch.Tensor]]] = {}
_DTYPES = (torch.bfloat16, torch.float32, torch.uint8, torch.int64)


def payload_sizes(total: int) -> list[int]:
    """Byte sizes of a model-like payload of about ``total`` bytes: a few large tensors that
    span buckets (none a multiple of a bucket), many medium ones, many small ones."""
    large = [total * 3 // 16 + 7] * 4  # 75 %
    medium = [total // 8 // 64] * 64  # 12.5 %
    small = [4096 + 4 * i for i in range(min(1000, max(1, total // 8 // 4096)))]
    return large + medium + small


def soak_weights(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``params["sizes"]``: tensor sizes in bytes. The tensors are made once per process and
    kept (the policy's model is always resident); each refit changes their first element, so
    every refit moves different bytes without the cost of making new random data."""
    key = repr(params["sizes"])
    if key not in _CACHE:
        generator = torch.Generator().manual_seed(int(params.get("seed", 0)))
        made = []
        for i, nbytes in enumerate(params["sizes"]):
            dtype = _DTYPES[i % len(_DTYPES)]
            raw = torch.randint(
                0, 256, (int(nbytes) // dtype.itemsize * dtype.itemsize,), dtype=torch.uint8, generator=generator
            )
            made.append((f"soak.{i}", raw.view(dtype)))
        _CACHE[key] = made
    for name, tensor in _CACHE[key]:
        if tensor.numel():
            tensor.view(torch.uint8)[0] = refit_index % 251
        yield name, tensor


# --- sampling worker processes from outside -----------------------------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_held(pid: int) -> list[str]:
    """``/dev/shm`` files process ``pid`` maps or has open."""
    held: set[str] = set()
    with open(f"/proc/{pid}/maps") as maps:
        held.update(line.split(None, 5)[-1].strip() for line in maps if "/dev/shm/" in line)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            held.add(target)
    return sorted(held)


def sample(pid: int) -> dict[str, Any]:
    return {"rss_bytes": rss_bytes(pid), "fds": descriptors(pid), "shm": shm_held(pid)}


class PidPool(Protocol):
    def __len__(self) -> int: ...

    def pid(self, index: int) -> int: ...


# --- the run ----------------------------------------------------------------------------------


def run_soak(
    coordinator: RefitCoordinator,
    pool: PidPool,
    *,
    refits: int,
    bucket_size: int,
    settle: int = 10,
    log: Any = None,
) -> dict[str, Any]:
    """Set up ``coordinator`` (1 policy, 1 rollout over ``pool``), run ``refits`` refits,
    finalize; returns the samples and the verdict (see the module docstring)."""
    if not 0 < settle < refits:
        raise ValueError(f"settle must be in [1, refits), got {settle} for {refits} refits")
    roles = {"policy": pool.pid(0), "rollout": pool.pid(1)}
    shm_before = sorted(os.listdir("/dev/shm"))
    coordinator.setup()
    samples: dict[str, list[dict[str, Any]]] = {role: [] for role in roles}
    seconds: list[float] = []
    transfer_seconds: list[float] = []
    payload = 0
    started = time.monotonic()
    for index in range(refits):
        began = time.perf_counter()
        report = coordinator.refit()
        seconds.append(time.perf_counter() - began)
        payload = report.rollout[0]["stats"]["payload_bytes"]
        transfer_seconds.append(report.rollout[0]["stats"]["seconds"])
        for role, pid in roles.items():
            samples[role].append(sample(pid))
        if log is not None and (index + 1) % max(1, refits // 10) == 0:
            log(
                f"refit {index + 1}/{refits}: {seconds[-1]:.2f}s, "
                + ", ".join(
                    f"{r} RSS {s[-1]['rss_bytes'] / MIB:.0f} MiB fds {s[-1]['fds']}" for r, s in samples.items()
                )
            )
    elapsed = time.monotonic() - started
    coordinator.finalize()
    after_finalize = {role: sample(pid) for role, pid in roles.items()}
    shm_after = sorted(os.listdir("/dev/shm"))
    checks: dict[str, dict[str, Any]] = {}
    for role, series in samples.items():
        first, last = series[settle - 1], series[-1]
        growth = last["rss_bytes"] - first["rss_bytes"]
        checks[role] = {
            "rss_at_settle_bytes": first["rss_bytes"],
            "rss_at_end_bytes": last["rss_bytes"],
            "rss_growth_bytes": growth,
            "rss_growth_ok": growth < bucket_size,
            "rss_max_bytes": max(s["rss_bytes"] for s in series[settle - 1 :]),
            "fds_at_settle": first["fds"],
            "fds_at_end": last["fds"],
            "fds_ok": all(s["fds"] == first["fds"] for s in series[settle - 1 :]),
            "shm_held": sorted({name for s in series for name in s["shm"]}),
            "shm_ok": not any(s["shm"] for s in series),
        }
    new_shm = sorted(set(shm_after) - set(shm_before))
    ours = [name for name in new_shm if name.startswith(SHM_PREFIXES)]
    return {
        "refits": refits,
        "settle": settle,
        "bucket_size": bucket_size,
        "payload_bytes": payload,
        "seconds_total": elapsed,
        "refit_seconds": {"median": statistics.median(seconds), "max": max(seconds), "first": seconds[0]},
        "receive_seconds_median": statistics.median(transfer_seconds),
        "receive_gbps_median": payload / statistics.median(transfer_seconds) / 1e9,
        "checks": checks,
        "after_finalize": after_finalize,
        "dev_shm_new_entries": ours,
        "dev_shm_new_entries_of_other_programs": sorted(set(new_shm) - set(ours)),
        "ok": all(c["rss_growth_ok"] and c["fds_ok"] and c["shm_ok"] for c in checks.values()) and not ours,
        "series": {
            role: [{"rss_bytes": s["rss_bytes"], "fds": s["fds"]} for s in series] for role, series in samples.items()
        },
    }


def coordinator_for(pool: LocalProcessPool, *, timeout_s: float) -> RefitCoordinator:
    return RefitCoordinator(pool, num_policy=1, num_rollout=1, timeout_s=timeout_s)


def summary(result: dict[str, Any]) -> str:
    lines = [
        f"Soak: {result['refits']} refits of {result['payload_bytes'] / MIB:.0f} MiB through gloo_cpu "
        f"(1 policy -> 1 rollout process, {result['bucket_size'] / MIB:g} MiB buckets), every one checked "
        f"bit-exact by digest; median {result['refit_seconds']['median']:.2f} s per refit with the digests "
        f"({result['receive_seconds_median']:.2f} s receiving, {result['receive_gbps_median']:.2f} GB/s), "
        f"{result['seconds_total']:.0f} s in all.",
        "",
        f"| process | RSS at refit {result['settle']} | RSS at refit {result['refits']} "
        "| growth | fds | /dev/shm held |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for role, c in result["checks"].items():
        lines.append(
            f"| {role} | {c['rss_at_settle_bytes'] / MIB:.1f} MiB | {c['rss_at_end_bytes'] / MIB:.1f} MiB | "
            f"{c['rss_growth_bytes'] / MIB:+.1f} MiB | {c['fds_at_settle']} -> {c['fds_at_end']} | "
            f"{len(c['shm_held'])} |"
        )
    lines.append("")
    lines.append(
        f"New /dev/shm entries: {len(result['dev_shm_new_entries'])} "
        f"(and {len(result['dev_shm_new_entries_of_other_programs'])} made by other programs meanwhile). "
        f"Verdict: {'PASS' if result['ok'] else 'FAIL'}."
    )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--refits", type=int, default=200)
    parser.add_argument(
        "--payload", type=parse_size, default=256 * MIB, help="about this many bytes per refit (256MiB)"
    )
    parser.add_argument("--bucket", type=parse_size, default=64 * MIB, help="bucket size (64MiB)")
    parser.add_argument("--settle", type=int, default=10, help="refit from which growth is measured (10)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per lifecycle step (600)")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=1,
        num_rollout=1,
        bucket_size=args.bucket,
        engine_kwargs={"timeout_s": args.timeout},
        weights="benchmarks.soak:soak_weights",
        weights_params={"sizes": payload_sizes(args.payload)},
    )
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    load_before = os.getloadavg()[0]
    with LocalProcessPool(specs, labels=labels, env=env) as pool:
        result = run_soak(
            coordinator_for(pool, timeout_s=args.timeout),
            pool,
            refits=args.refits,
            bucket_size=args.bucket,
            settle=args.settle,
            log=lambda m: print(m, flush=True),
        )
    result["machine"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
