"""``python -m benchmarks.delta``: delta refits against full ones, side by side in one run.

Three measurements (issue 34, point 2):

* **workload**: how much of a bf16 rollout copy changes per training step. A model made here
  (``--workload-layers`` linear layers of ``--workload-hidden``) is trained with fp32 master
  weights and AdamW on random data at each learning rate of ``--lrs``, and cast to bf16 after
  each step; the fraction of bf16 elements whose bits changed from the step before is reported.
* **refits**: bf16 weights of ``--size`` bytes, ready in one policy process's memory, sent to one
  rollout process over ``gloo_cpu`` (paired), by two pools at once, refits alternating: *full*
  (every byte) and *delta* (the ``delta`` engine option). Before each refit, untimed, both
  policies flip the lowest bit of the same random ``--fraction`` of their elements (positions
  drawn with replacement: the changed count is what the delta refit's statistics report). Each
  pool's first refit is checked digest by digest. The delta time includes the sender's diff,
  the digests and both sides' baseline copies. Then the curve: delta and full refit times at
  each of ``--curve`` fractions, and where the delta refit stops being faster.
* **diff**: :func:`ckpt_core.delta.diff` of a 128 MiB bf16 tensor (1% changed) against a copy of
  the same bytes (``Tensor.copy_``), best of 5 each, in this process.

Goals at 1% changed: wire bytes <= 1.2 x changed elements x (value + position bytes); delta time
<= 0.2 x full; diff >= 0.5 x copy throughput. Writes ``delta.json`` and ``delta.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ckpt_core.cli import parse_size
from ckpt_core.delta import diff, patch_bytes
from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import RefitWorker, refit_worker_specs
from ckpt_core.testing.weights import Weights

from .methods import worker_env

HERE = Path(__file__).resolve().parent
ELEMENTS_PER_TENSOR = 4096 * 4096  # 32 MiB of bf16: a 4096 x 4096 projection
_WEIGHTS: list[tuple[str, torch.Tensor]] = []


def ready(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """This process's weights as they are now (made on first use; :class:`SteppingPolicy`
    changes them between refits)."""
    if not _WEIGHTS:
        generator = torch.Generator().manual_seed(int(params["seed"]))
        count, elements = int(params["tensors"]), int(params["elements"])
        for i in range(count):
            _WEIGHTS.append((f"layers.{i}.weight", (torch.randn(elements, generator=generator) * 0.02).bfloat16()))
    yield from _WEIGHTS


class SteppingPolicy(RefitWorker):
    """A policy worker whose weights take a "training step" on request, outside any refit."""

    def step(self, *, fraction: float, seed: int) -> int:
        """Flip the lowest bit of ``fraction`` of every weight's elements (drawn with
        replacement, the same on every process given ``seed``); the positions drawn."""
        assert _WEIGHTS, "refit once before stepping (the weights are made on first use)"
        generator = torch.Generator().manual_seed(seed)
        drawn = 0
        for _, tensor in _WEIGHTS:
            count = round(tensor.numel() * fraction)
            positions = torch.randint(tensor.numel(), (count,), generator=generator)
            bits = tensor.view(-1).view(torch.int16)
            bits[positions] ^= 1
            drawn += count
        return drawn


def open_pool(
    stack: contextlib.ExitStack, params: dict[str, Any], bucket_size: int, *, delta: bool
) -> RefitCoordinator:
    specs, labels = refit_worker_specs(
        backend="gloo_cpu",
        num_policy=1,
        num_rollout=1,
        bucket_size=bucket_size,
        engine_kwargs={"topology": "paired", "timeout_s": 300.0, "delta": delta},
        weights="benchmarks.delta:ready",
        weights_params=params,
    )
    specs[0]["service"] = "benchmarks.delta:SteppingPolicy"
    tag = "delta" if delta else "full"
    pool = stack.enter_context(LocalProcessPool(specs, labels=[f"{tag}-{label}" for label in labels], env=worker_env()))
    coordinator = RefitCoordinator(pool, num_policy=1, num_rollout=1, timeout_s=600.0, topology="paired")
    coordinator.setup()
    stack.callback(coordinator.finalize)
    return coordinator


def step(coordinators: dict[str, RefitCoordinator], fraction: float, seed: int) -> None:
    for coordinator in coordinators.values():
        (result,) = coordinator.pool.call([(0, "step", {"fraction": fraction, "seed": seed})], 600.0)
        if not result.ok:
            raise RuntimeError(result.describe())


def timed_refit(coordinator: RefitCoordinator) -> dict[str, Any]:
    start = time.perf_counter()
    report = coordinator.refit()
    seconds = time.perf_counter() - start
    (policy,), (rollout,) = report.policy, report.rollout
    return {
        "seconds": seconds,
        "sender_seconds": float(policy["stats"]["seconds"]),
        "receiver_seconds": float(rollout["stats"]["seconds"]),
        "payload_bytes": int(rollout["stats"]["payload_bytes"]),
        "changed_elements": int(rollout["stats"]["changed_elements"]),
        "patched_tensors": int(rollout["stats"]["patched_tensors"]),
        "policy_peak_rss_bytes": int(policy["peak_rss_bytes"]),
        "rollout_peak_rss_bytes": int(rollout["peak_rss_bytes"]),
    }


def refits(params: dict[str, Any], bucket_size: int, reps: int, fraction: float, curve: list[float]) -> dict[str, Any]:
    model_bytes = 2 * int(params["tensors"]) * int(params["elements"])
    seed = 1000
    rows: dict[str, list[dict[str, Any]]] = {"full": [], "delta": []}
    curve_rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        pools = {
            "full": open_pool(stack, params, bucket_size, delta=False),
            "delta": open_pool(stack, params, bucket_size, delta=True),
        }
        for coordinator in pools.values():  # the first refit: whole, checked digest by digest
            coordinator.refit()
            coordinator.verify = False
        for _ in range(reps):
            seed += 1
            step(pools, fraction, seed)
            for name, coordinator in pools.items():
                rows[name].append(timed_refit(coordinator))
                print(f"{name} at {fraction:g}: {rows[name][-1]}", flush=True)
        for point in curve:
            seconds: dict[str, list[float]] = {"full": [], "delta": []}
            moved, changed = [], []
            for _ in range(2):
                seed += 1
                step(pools, point, seed)
                for name, coordinator in pools.items():
                    row = timed_refit(coordinator)
                    seconds[name].append(row["seconds"])
                    if name == "delta":
                        moved.append(row["payload_bytes"])
                        changed.append(row["changed_elements"])
            curve_rows.append(
                {
                    "fraction": point,
                    "changed_fraction": statistics.median(changed) / (model_bytes // 2),
                    "delta_seconds": statistics.median(seconds["delta"]),
                    "full_seconds": statistics.median(seconds["full"]),
                    "delta_payload_bytes": int(statistics.median(moved)),
                }
            )
            print(f"curve {curve_rows[-1]}", flush=True)
    full = statistics.median(r["seconds"] for r in rows["full"])
    delta = statistics.median(r["seconds"] for r in rows["delta"])
    last = rows["delta"][-1]
    bound = patch_bytes(last["changed_elements"], int(params["elements"]), 2)  # value and position bytes
    faster = [row["fraction"] for row in curve_rows if row["delta_seconds"] < row["full_seconds"]]
    # The crossover: the first fraction measured, above every one where delta was faster, where it was not.
    slower_after = [row["fraction"] for row in curve_rows if row["fraction"] > max(faster, default=-1.0)]
    return {
        "model_bytes": model_bytes,
        "params": params,
        "bucket_size": bucket_size,
        "fraction": fraction,
        "reps": rows,
        "full_median_seconds": full,
        "delta_median_seconds": delta,
        "time_ratio": delta / full,
        "changed_fraction": last["changed_elements"] / (model_bytes // 2),
        "delta_payload_bytes": last["payload_bytes"],
        "patch_bound_bytes": bound,
        "bytes_ratio": last["payload_bytes"] / bound if bound else float("nan"),
        "full_payload_bytes": rows["full"][-1]["payload_bytes"],
        "curve": curve_rows,
        "fastest_fraction_where_delta_wins": max(faster) if faster else None,
        "crossover_fraction": min(slower_after) if faster and slower_after else None,
    }


def diff_throughput(elements: int, fraction: float, repeats: int = 5) -> dict[str, Any]:
    """Best-of-``repeats`` seconds of ``diff`` and of a copy, over the same bytes."""
    generator = torch.Generator().manual_seed(7)
    old = torch.randn(elements, generator=generator).bfloat16()
    new = old.clone()
    positions = torch.randint(elements, (round(elements * fraction),), generator=generator)
    new.view(torch.int16)[positions] ^= 1
    target = torch.empty_like(new)

    def best(work: Any) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return min(times)

    diff_s = best(lambda: diff(old, new, name="w"))
    copy_s = best(lambda: target.copy_(new))
    return {
        "bytes": new.nbytes,
        "fraction": fraction,
        "threads": torch.get_num_threads(),
        "diff_seconds": diff_s,
        "copy_seconds": copy_s,
        "ratio_to_copy": copy_s / diff_s,
    }


def workload(hidden: int, layers: int, lrs: list[float], steps: int) -> list[dict[str, Any]]:
    """The changed fraction of a bf16 copy per AdamW step at each learning rate."""
    rows = []
    for lr in lrs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        previous = [p.detach().bfloat16() for p in model.parameters()]
        total = sum(p.numel() for p in previous)
        fractions = []
        for _ in range(steps):
            inputs = torch.randn(64, hidden)
            loss = (model(inputs) - inputs).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            current = [p.detach().bfloat16() for p in model.parameters()]
            changed = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(previous, current))
            fractions.append(changed / total)
            previous = current
        rows.append({"lr": lr, "elements": total, "changed_fraction_per_step": fractions})
        print(f"workload lr {lr:g}: {[f'{f:.4f}' for f in fractions]}", flush=True)
    return rows


def report_table(r: dict[str, Any]) -> str:
    mib = 1 << 20
    refit = r["refits"]
    d = r["diff"]
    lines = [
        f"Delta vs full refits, gloo_cpu paired 1 -> 1, {refit['model_bytes'] / mib:.0f} MiB of bf16 ready in memory, "
        f"{refit['bucket_size'] / mib:g} MiB buckets, medians of {len(refit['reps']['full'])} alternating refits.",
        "",
        "Workload (fp32 masters, AdamW, cast to bf16 each step): changed fraction per step",
        "",
        "| lr | elements | per step |",
        "| --- | --- | --- |",
    ]
    for row in r["workload"]:
        per_step = ", ".join(f"{f:.2%}" for f in row["changed_fraction_per_step"])
        lines.append(f"| {row['lr']:g} | {row['elements']} | {per_step} |")
    lines += [
        "",
        f"At {refit['changed_fraction']:.2%} changed:",
        "",
        "| refit | time | bytes |",
        "| --- | --- | --- |",
        f"| full | {refit['full_median_seconds']:.3f} s | {refit['full_payload_bytes'] / mib:.1f} MiB |",
        f"| delta | {refit['delta_median_seconds']:.3f} s | {refit['delta_payload_bytes'] / mib:.2f} MiB |",
        "",
        f"Time delta / full: {refit['time_ratio']:.2f} (goal <= 0.2). Bytes / (changed x (value + position)): "
        f"{refit['bytes_ratio']:.3f} (goal <= 1.2). diff / copy throughput: {d['ratio_to_copy']:.2f} "
        f"(goal >= 0.5; {d['bytes'] / mib:.0f} MiB, {d['threads']} threads, best of 5).",
        "",
        "| changed (asked) | changed (measured) | delta | full | delta bytes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in refit["curve"]:
        lines.append(
            f"| {row['fraction']:.2%} | {row['changed_fraction']:.2%} | {row['delta_seconds']:.3f} s | "
            f"{row['full_seconds']:.3f} s | {row['delta_payload_bytes'] / mib:.1f} MiB |"
        )
    crossover, wins = refit["crossover_fraction"], refit["fastest_fraction_where_delta_wins"]
    if wins is None:
        verdict = "Delta refits were slower than full ones at every fraction measured."
    elif crossover is None:
        verdict = "Delta refits were faster at every fraction measured."
    else:
        verdict = f"Delta refits are faster up to {wins:.1%} changed and slower from {crossover:.1%}."
    lines += ["", verdict, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--elements-per-tensor", type=int, default=ELEMENTS_PER_TENSOR)
    parser.add_argument("--fraction", type=float, default=0.01)
    parser.add_argument("--curve", type=float, nargs="*", default=[0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--bucket-size", type=parse_size, default=32 << 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--workload-hidden", type=int, default=1024)
    parser.add_argument("--workload-layers", type=int, default=4)
    parser.add_argument("--workload-steps", type=int, default=5)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--diff-elements", type=int, default=64 << 20)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    tensors = max(1, args.size // (2 * args.elements_per_tensor))
    params = {"seed": 1, "tensors": tensors, "elements": args.elements_per_tensor}
    results = {
        "workload": workload(args.workload_hidden, args.workload_layers, args.lrs, args.workload_steps),
        "diff": diff_throughput(args.diff_elements, 0.01),
        "refits": refits(params, args.bucket_size, args.reps, args.fraction, args.curve),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "delta.json").write_text(json.dumps(results, indent=2) + "\n")
    table = report_table(results)
    (args.out / "delta.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
