"""``python -m benchmarks.delta``: delta refits against full ones and against their floor, side by side in one run.

Four measurements (issue 50, points 1 and 2; the workload from issue 34):

* **workload**: how much of a bf16 rollout copy changes per training step. A model made here
  (``--workload-layers`` linear layers of ``--workload-hidden``) is trained with fp32 master
  weights and AdamW on random data at each learning rate of ``--lrs``, and cast to bf16 after
  each step; the fraction of bf16 elements whose bits changed from the step before is reported.
* **kernels**: on ``--kernel-size`` of bf16 (1% changed), in this process with torch's threads
  (every core by default), in 9 rounds that each time every pass once, in turn, each
  ``PASS_PAUSE`` after the one before (medians; each ratio the median of its rounds' ratios): a
  copy of the tensor into warm memory (the memcpy); the sender's diff
  (:func:`ckpt_core.refit.delta.compare`: compare, lay the patch out, patch the baseline in
  place and make the new version's digest from the baseline's, one pass); the receiver's apply
  (decode the patch, patch its copy and hash it, one pass). Goal: each at least 0.6x the
  memcpy's speed (the memcpy's time over its own), for the same tensor.
* **refits**: ``--size`` of bf16 weights, ready in one policy process's memory, sent to one
  rollout process by each backend of ``--backends`` (``gloo_cpu`` paired, ``cuda_ipc`` in host
  memory), by two pools at once: *full* (every byte) and *delta* (the ``delta`` option). For
  each fraction of ``--fractions``, ``--reps`` times: both policies flip the lowest bit of that
  fraction of their elements (each element drawn independently: the fraction is exact up to
  sampling), untimed; the delta policy measures the **floor** (below); then a full and a delta
  refit, in turn. A refit's time is its engines' (from the sender's first weight to the
  receiver's last, the longer of the two sides' ``RefitStats.seconds``); the coordinator's
  wall time beside it adds its calls to the processes. Each pool's first refit is whole and
  checked digest by digest; then ``--settle`` rounds at the first fraction (both pools) are
  what a stream pays once while its sender learns what whole weights cost
  (:data:`ckpt_core.refit.delta.choice.EXPLORE`): reported apart, in no median. A later fraction's
  first refits show how the choice follows a jump in the fraction.
* **floor**: measured in the delta policy process (its share of the cores, as the refit has it)
  right after each step, over its weights and its copy of the version before: one pass that
  reads both and writes the patch bytes (the comparison alone:
  :func:`ckpt_core._internal.bitdiff.find` without patching the copy or hashing). Beside it, in
  the same process: the rest of what a delta refit must do (the baseline patched in place, the
  new version's digest made from the old one's; the receiver's patch of its copy, hashed or
  followed from its terms), each alone; and the **pair floor**: the sender's whole pass and the
  receiver's patch of a copy of its own run at once on two threads, weight by weight, which is
  what the two sides' unavoidable passes take where they share one host's memory and cores (as
  the refit's two processes do here).

Goals at 0.1% and 1% changed: the delta refit <= 1.3x the floor and below the full refit
(<= 0.6x at 1%); at 40%, <= 1.1x the full refit. Writes ``delta.json`` and ``delta.md`` to
``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckpt_core._internal import bitdiff
from ckpt_core.cli import parse_size
from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import RefitWorker, refit_worker_specs
from ckpt_core.refit.delta import Patch, apply, apply_and_digest, audit, compare, decode, digest
from ckpt_core.testing.weights import Weights

from .methods import worker_env
from .outputs import write_results

HERE = Path(__file__).resolve().parent
ELEMENTS_PER_TENSOR = 4096 * 4096  # 32 MiB of bf16: a 4096 x 4096 projection
BACKENDS = {  # backend -> (engine options, coordinator topology)
    "gloo_cpu": ({"topology": "paired"}, "paired"),
    "cuda_ipc": ({"device": "cpu"}, "broadcast"),
}
GOALS = {"floor": 1.3, "full_at_1%": 0.6, "full_at_40%": 1.1, "kernels": 0.6}
KERNEL_ROUNDS = 9
PASS_PAUSE = 0.02
"""Seconds each kernel pass waits before it is timed. torch's OpenMP threads go on spinning for
a few milliseconds after a parallel op: a diff timed right after the copy ran 1.23-1.27x as long
as one timed 20 ms later (paired medians of 21, three runs), its parts sharing a core with a
spinning thread. Each pass gets both cores, as the goal states."""
_WEIGHTS: list[tuple[str, torch.Tensor]] = []
_PREVIOUS: list[torch.Tensor] = []


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
    """A policy worker whose weights take a "training step" on request, outside any refit, and
    that measures the floor of a delta refit over its last step."""

    def step(self, *, fraction: float, seed: int) -> int:
        """Flip the lowest bit of each element with probability ``fraction`` (the same
        elements on every process given ``seed``), keeping the version before; the elements
        changed."""
        assert _WEIGHTS, "refit once before stepping (the weights are made on first use)"
        generator = torch.Generator().manual_seed(seed)
        keep = not _PREVIOUS
        changed = 0
        for i, (_, tensor) in enumerate(_WEIGHTS):
            if keep:
                _PREVIOUS.append(tensor.clone())
            else:
                _PREVIOUS[i].copy_(tensor)
            flips = torch.rand(tensor.numel(), generator=generator) < fraction
            bits = tensor.view(-1).view(torch.int16)
            bits ^= flips.to(torch.int16)
            changed += int(flips.sum())
        return changed

    def floor(self) -> dict[str, float]:
        """Seconds, over every weight and its version before the last step, in this process:
        ``floor``, the comparison alone (read both, write the patch bytes); ``update`` and
        ``digest``, the same pass also patching the old version in place, or also making the
        new one's digest (from the old one's, as a sender that kept it does); ``apply``, the
        receiver's patch of a copy of the old version (the patch's values written in, the
        overwritten ones kept); ``apply_digest``, that and its hash, as a receiver's first patch
        of a copy does; ``apply_terms``, that with the digest made from the copy's terms and the
        words written, and one class of leaves audited, as its later patches do; ``pair``, the
        sender's pass (compare, update, digest) and the receiver's (``apply_terms``, on a copy
        of its own) run at once, on two threads, weight by weight: what the two passes a delta
        refit cannot do without take where both sides share one host's memory and cores."""
        assert _PREVIOUS, "step before measuring the floor"
        keys = ("floor", "update", "digest", "apply", "apply_digest", "apply_terms", "pair")
        seconds = dict.fromkeys(keys, 0.0)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pair-receiver") as receiver:
            for (_, new), old in zip(_WEIGHTS, _PREVIOUS):
                self._floor_of(new, old, seconds, receiver)
        return seconds

    @staticmethod
    def _floor_of(
        new: torch.Tensor, old: torch.Tensor, seconds: dict[str, float], receiver: concurrent.futures.Executor
    ) -> None:
        """:meth:`floor`'s parts for one weight, added to ``seconds``; ``old`` is left as it was."""
        new_bits, old_bits = new.view(torch.int16).numpy(), old.view(torch.int16).numpy()
        compare = functools.partial(
            bitdiff.find, old_bits, new_bits, max_changed=new.numel() // 3, position_dtype=np.dtype(np.int32), prefix=0
        )
        start = time.perf_counter()
        found = compare(with_digest=False)
        seconds["floor"] += time.perf_counter() - start
        old_digest = bitdiff.digest(old_bits.view(np.uint8))  # what the sender keeps from the refit before
        start = time.perf_counter()
        compare(with_digest=True, old_digest=old_digest)
        seconds["digest"] += time.perf_counter() - start
        if found.over or found.blob is None:
            return
        at, _ = bitdiff.layout(found.count, 0, 4, 2)
        where, values = found.blob[: 4 * found.count].view(np.int32), found.blob[at:].view(np.int16)
        nothing = np.empty(0, dtype=np.int32)
        terms = bitdiff.patch(old_bits, nothing, old_bits[:0], keep=False, with_digest=True).terms  # untimed
        for key, hashed in (("apply", False), ("apply_digest", True)):
            start = time.perf_counter()
            done = bitdiff.patch(old_bits, where, values, keep=True, with_digest=hashed)
            seconds[key] += time.perf_counter() - start
            assert done.saved is not None
            bitdiff.kernels().scatter(old_bits, where, done.saved)  # the old version again
        start = time.perf_counter()
        saved = _apply_with_terms(old_bits, where, values, terms)
        seconds["apply_terms"] += time.perf_counter() - start
        bitdiff.kernels().scatter(old_bits, where, saved)
        start = time.perf_counter()
        updated = compare(with_digest=False, update=True)
        seconds["update"] += time.perf_counter() - start
        assert updated.saved is not None
        bitdiff.kernels().scatter(old_bits, where, updated.saved)
        held = old_bits.copy()  # the pair's receiver patches a copy of its own
        start = time.perf_counter()
        applying = receiver.submit(_apply_with_terms, held, where, values, terms)
        updated = compare(with_digest=True, update=True, old_digest=old_digest)
        applying.result()
        seconds["pair"] += time.perf_counter() - start
        assert updated.saved is not None
        bitdiff.kernels().scatter(old_bits, where, updated.saved)


def _apply_with_terms(held: np.ndarray, where: np.ndarray, values: np.ndarray, terms: np.ndarray | None) -> np.ndarray:
    """A receiver's patch of ``held`` whose terms it knows, as
    :class:`ckpt_core.refit.delta.baselines.DeltaReceiver` makes it (the digest followed and a
    class audited where the patch is sparse, else hashed whole); the values it overwrote."""
    done = bitdiff.patch(held, where, values, keep=True, with_digest=True, terms=terms)
    if terms is not None and done.terms is not None and not done.hashed:
        bitdiff.class_terms(held, 0)
    assert done.saved is not None
    return done.saved


def open_pool(
    stack: contextlib.ExitStack, backend: str, params: dict[str, Any], bucket_size: int, *, delta: bool
) -> RefitCoordinator:
    options, topology = BACKENDS[backend]
    specs, labels = refit_worker_specs(
        backend=backend,
        num_policy=1,
        num_rollout=1,
        bucket_size=bucket_size,
        engine_kwargs={**options, "timeout_s": 300.0, "delta": delta},
        weights="benchmarks.delta:ready",
        weights_params=params,
    )
    specs[0]["service"] = "benchmarks.delta:SteppingPolicy"
    tag = f"{backend}-{'delta' if delta else 'full'}"
    pool = stack.enter_context(LocalProcessPool(specs, labels=[f"{tag}-{label}" for label in labels], env=worker_env()))
    coordinator = RefitCoordinator(pool, num_policy=1, num_rollout=1, timeout_s=600.0, topology=topology)
    coordinator.setup()
    stack.callback(coordinator.finalize)
    return coordinator


def call_policy(coordinator: RefitCoordinator, method: str, **kwargs: Any) -> Any:
    (result,) = coordinator.pool.call([(0, method, kwargs)], 600.0)
    if not result.ok:
        raise RuntimeError(result.describe())
    return result.value


def timed_refit(coordinator: RefitCoordinator) -> dict[str, Any]:
    start = time.perf_counter()
    report = coordinator.refit()
    wall = time.perf_counter() - start
    (policy,), (rollout,) = report.policy, report.rollout
    sent, got = policy["stats"], rollout["stats"]
    return {
        "seconds": max(float(sent["seconds"]), float(got["seconds"])),
        "wall_seconds": wall,
        "sender": sent,
        "receiver": got,
        "policy_lifetime_peak_rss_bytes": int(policy["lifetime_peak_rss_bytes"]),
        "rollout_lifetime_peak_rss_bytes": int(rollout["lifetime_peak_rss_bytes"]),
    }


def refits(
    backend: str, params: dict[str, Any], bucket_size: int, fractions: list[float], reps: int, settle: int
) -> dict[str, Any]:
    """Full and delta refits side by side at each fraction, with the floor of each step, after
    ``settle`` rounds at the first fraction."""
    rows = []
    settling: list[dict[str, Any]] = []
    seed = 1000
    with contextlib.ExitStack() as stack:
        pools = {
            "full": open_pool(stack, backend, params, bucket_size, delta=False),
            "delta": open_pool(stack, backend, params, bucket_size, delta=True),
        }
        for coordinator in pools.values():  # the first refit: whole, checked digest by digest
            coordinator.refit()
            coordinator.verify = False
        for _ in range(settle):
            seed += 1
            for pool in pools.values():
                call_policy(pool, "step", fraction=fractions[0], seed=seed)
            refit = timed_refit(pools["delta"])
            settling.append({"seconds": refit["seconds"], "choice": choice_of(refit), "fraction": fractions[0]})
            timed_refit(pools["full"])
        for fraction in fractions:
            samples: dict[str, list[Any]] = {"full": [], "delta": [], "floor": [], "changed": []}
            for _ in range(reps):
                seed += 1
                changed = [call_policy(pool, "step", fraction=fraction, seed=seed) for pool in pools.values()]
                assert changed[0] == changed[1]
                samples["changed"].append(changed[0])
                samples["floor"].append(call_policy(pools["delta"], "floor"))
                for name, coordinator in pools.items():
                    samples[name].append(timed_refit(coordinator))
            rows.append(summarize(fraction, samples, params))
            print(f"{backend} at {fraction:.2%}: {brief(rows[-1])}", flush=True)
    return {"backend": backend, "options": BACKENDS[backend][0], "settling": settling, "rows": rows}


def choice_of(refit: dict[str, Any]) -> dict[str, int]:
    """How the delta sender sent a refit's weights (its ``RefitStats``)."""
    return {
        key: refit["sender"][key]
        for key in ("patched_tensors", "whole_tensors", "untracked_tensors", "chosen_whole_tensors")
    }


def summarize(fraction: float, samples: dict[str, list[Any]], params: dict[str, Any]) -> dict[str, Any]:
    elements = int(params["tensors"]) * int(params["elements"])
    floors = {key: statistics.median(f[key] for f in samples["floor"]) for key in samples["floor"][0]}
    delta, full = samples["delta"], samples["full"]
    delta_s = statistics.median(r["seconds"] for r in delta)
    full_s = statistics.median(r["seconds"] for r in full)
    return {
        "fraction": fraction,
        "changed_fraction": statistics.median(samples["changed"]) / elements,
        "full_seconds": full_s,
        "delta_seconds": delta_s,
        "full_wall_seconds": statistics.median(r["wall_seconds"] for r in full),
        "delta_wall_seconds": statistics.median(r["wall_seconds"] for r in delta),
        "delta_over_full": delta_s / full_s,
        "floor_seconds": floors["floor"],
        "delta_over_floor": delta_s / floors["floor"],
        "pair_floor_seconds": floors["pair"] or None,  # 0: no patch was made, no pair measured
        "delta_over_pair_floor": delta_s / floors["pair"] if floors["pair"] else None,
        "floor_parts_seconds": floors,
        "full_payload_bytes": int(statistics.median(r["receiver"]["payload_bytes"] for r in full)),
        "delta_payload_bytes": int(statistics.median(r["receiver"]["payload_bytes"] for r in delta)),
        "delta_sender_delta_seconds": statistics.median(r["sender"]["delta_seconds"] for r in delta),
        "delta_receiver_delta_seconds": statistics.median(r["receiver"]["delta_seconds"] for r in delta),
        "choices": [choice_of(r) for r in delta],
        "delta_refits_seconds": [r["seconds"] for r in delta],
        "full_refits_seconds": [r["seconds"] for r in full],
        # Each mode's processes since they started (the rows before this one included).
        "lifetime_peak_rss_bytes": {
            name: max(max(r["policy_lifetime_peak_rss_bytes"], r["rollout_lifetime_peak_rss_bytes"]) for r in runs)
            for name, runs in (("full", full), ("delta", delta))
        },
    }


def brief(row: dict[str, Any]) -> str:
    return (
        f"full {row['full_seconds']:.3f} s, delta {row['delta_seconds']:.3f} s ({row['delta_over_full']:.2f}x full, "
        f"{row['delta_over_floor']:.2f}x floor {row['floor_seconds']:.3f} s), "
        f"{row['delta_payload_bytes'] / 2**20:.1f} MiB"
    )


def kernels(elements: int, fraction: float, rounds: int = KERNEL_ROUNDS) -> dict[str, Any]:
    """Seconds of the sender's diff, the receiver's apply and a copy, of one bf16 tensor of
    ``elements`` with ``fraction`` of them changed, on torch's threads: ``rounds`` rounds, each
    timing every pass once, in turn (each after :data:`PASS_PAUSE`); medians over the rounds,
    and each pass's ratio to the copy the median of its rounds' ratios (a pass and the copy it
    is held to run moments apart, so a quiet or busy spell of the machine weighs on both)."""
    generator = torch.Generator().manual_seed(7)
    old = (torch.randn(elements, generator=generator) * 0.02).bfloat16()
    new = old.clone()
    flips = torch.rand(elements, generator=generator) < fraction
    new.view(torch.int16).bitwise_xor_(flips.to(torch.int16))
    target = torch.empty_like(new)
    target.copy_(new)  # touched: the copy runs into warm memory
    baseline, held = old.clone(), old.clone()
    wire = compare(old, new, name="w", encoded=True).encoded
    assert wire is not None

    def timed(work: Callable[[], Callable[[], None] | None]) -> float:
        time.sleep(PASS_PAUSE)  # the pass before's worker threads idle again (see PASS_PAUSE)
        start = time.perf_counter()
        restore = work()
        seconds = time.perf_counter() - start
        if restore is not None:
            restore()  # untimed: the old version back for the next round
        return seconds

    def restore(tensor: torch.Tensor, undo: Patch) -> None:
        apply(tensor, undo, name="w")

    baseline_digest = digest(baseline)  # what a sender keeps from the refit before

    def diff() -> Callable[[], None]:
        found = compare(baseline, new, name="w", encoded=True, update=True, old_digest=baseline_digest)
        undo = found.undo
        assert undo is not None
        return functools.partial(restore, baseline, undo)

    def receive() -> Callable[[], None]:
        patch, _ = decode(wire, held, name="w")
        undo = apply_and_digest(held, patch, name="w").undo
        return functools.partial(restore, held, undo)

    nothing = Patch(torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=held.dtype), held.numel())
    held_terms = apply_and_digest(held, nothing, name="w").terms  # what a receiver knows of its copy, hashed once

    def receive_known() -> Callable[[], None]:
        patch, _ = decode(wire, held, name="w")
        applied = apply_and_digest(held, patch, name="w", terms=held_terms)
        if applied.terms is not None and not applied.hashed:
            audit(held, applied.terms, 0)
        return functools.partial(restore, held, applied.undo)

    diff()()  # each kernel loaded (or compiled) before it is timed
    receive()()
    receive_known()()

    def copy() -> None:
        target.copy_(new)

    passes = {"copy": copy, "diff": diff, "apply": receive, "apply_known": receive_known}
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(rounds):
        for name, work in passes.items():
            seconds[name].append(timed(work))
    results: dict[str, Any] = {
        "bytes": new.nbytes,
        "fraction": fraction,
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "round_seconds": seconds,
    }
    for name, times in seconds.items():
        results[f"{name}_seconds"] = statistics.median(times)
        if name != "copy":
            ratios = [copy_s / pass_s for copy_s, pass_s in zip(seconds["copy"], times)]
            results[f"{name}_ratio_to_copy"] = statistics.median(ratios)
    return results


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


def verdicts(results: dict[str, Any]) -> list[str]:
    """Each goal, met or missed, on this run's figures."""
    lines = []
    k = results["kernels"]
    for key, what in (
        ("diff_ratio_to_copy", "sender's diff"),
        ("apply_ratio_to_copy", "receiver's first apply of a copy"),
        ("apply_known_ratio_to_copy", "receiver's apply"),
    ):
        met = "met" if k[key] >= GOALS["kernels"] else "missed"
        lines.append(f"- {what}: {k[key]:.2f}x the memcpy's speed (goal >= {GOALS['kernels']}): {met}")
    for run in results["refits"]:
        for row in run["rows"]:
            at = f"{run['backend']} at {row['fraction']:.1%}"
            if row["fraction"] <= 0.01:
                floor_met = "met" if row["delta_over_floor"] <= GOALS["floor"] else "missed"
                below = "met" if row["delta_over_full"] < 1.0 else "missed"
                pair = (
                    f"the pair floor (both sides' passes at once) is "
                    f"{row['pair_floor_seconds'] / row['floor_seconds']:.2f}x the floor, the refit "
                    f"{row['delta_over_pair_floor']:.2f}x it"
                    if row["pair_floor_seconds"]
                    else "no pair floor (no patch was made)"
                )
                lines.append(
                    f"- {at}: {row['delta_over_floor']:.2f}x the floor (goal <= {GOALS['floor']}): {floor_met}; "
                    f"{row['delta_over_full']:.2f}x the full refit (goal < 1): {below}; {pair}"
                )
                if row["fraction"] == 0.01:
                    met = "met" if row["delta_over_full"] <= GOALS["full_at_1%"] else "missed"
                    lines.append(f"- {at}: goal <= {GOALS['full_at_1%']}x the full refit: {met}")
            if row["fraction"] == 0.4:
                met = "met" if row["delta_over_full"] <= GOALS["full_at_40%"] else "missed"
                lines.append(
                    f"- {at}: {row['delta_over_full']:.2f}x the full refit (goal <= {GOALS['full_at_40%']}): {met}"
                )
    return lines


def report_table(r: dict[str, Any]) -> str:
    mib = 1 << 20
    k = r["kernels"]
    setup = r["setup"]
    lines = [
        f"Delta refits against full ones and their floor: {setup['size'] / mib:.0f} MiB of bf16 in "
        f"{setup['tensors']} tensors, ready in one policy process's memory, 1 -> 1, {setup['bucket_size'] / mib:g} MiB "
        f"buckets; medians of {setup['reps']} refits per fraction, full and delta in turn. Times are the engines' "
        "(the longer side's RefitStats.seconds); each worker process has one thread (its share of the cores).",
        "",
        "## Goals",
        "",
        *verdicts(r),
        "",
        "## Workload: changed fraction per AdamW step (fp32 masters, cast to bf16)",
        "",
        "| lr | elements | per step |",
        "| --- | --- | --- |",
    ]
    for row in r["workload"]:
        per_step = ", ".join(f"{f:.2%}" for f in row["changed_fraction_per_step"])
        lines.append(f"| {row['lr']:g} | {row['elements']} | {per_step} |")
    lines += [
        "",
        f"## Kernels: {k['bytes'] / mib:.0f} MiB of bf16, {k['fraction']:.0%} changed, {k['threads']} threads, "
        f"medians of {k['rounds']} rounds (each timing every pass once, in turn, {PASS_PAUSE * 1000:.0f} ms "
        "after the one before; each ratio the median of its rounds' ratios)",
        "",
        "| pass | seconds | x memcpy speed |",
        "| --- | --- | --- |",
        f"| memcpy (copy_ into warm memory) | {k['copy_seconds']:.4f} | 1.00 |",
        f"| sender's diff (compare, patch laid out, baseline patched, new version's digest from the old one's) | "
        f"{k['diff_seconds']:.4f} | "
        f"{k['diff_ratio_to_copy']:.2f} |",
        f"| receiver's first apply of a copy (patch decoded, copy patched and hashed) | {k['apply_seconds']:.4f} | "
        f"{k['apply_ratio_to_copy']:.2f} |",
        f"| receiver's apply, its copy's terms known (patch decoded, copy patched, digest followed from "
        f"the terms and a sixteenth audited where the patch is sparse, else hashed whole) | "
        f"{k['apply_known_seconds']:.4f} | {k['apply_known_ratio_to_copy']:.2f} |",
    ]
    for run in r["refits"]:
        settled = "; ".join(
            f"{r['seconds']:.3f} s ({r['choice']['patched_tensors']} / {r['choice']['whole_tensors']} / "
            f"{r['choice']['untracked_tensors']})"
            for r in run.get("settling", [])
        )
        lines += [
            "",
            f"## Refits: {run['backend']} {run['options']}",
            "",
            f"While the choice settled (delta refits at {setup['fractions'][0]:.2%}, in no median; patched / whole / "
            f"untracked): {settled or 'none'}.",
            "",
            "| changed | full | delta | delta / full | floor | delta / floor | delta bytes | choices (patched / "
            "whole / untracked, of them chosen) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in run["rows"]:
            choice = row["choices"][-1]  # the choice it settled on
            lines.append(
                f"| {row['changed_fraction']:.2%} | {row['full_seconds']:.3f} s | {row['delta_seconds']:.3f} s | "
                f"{row['delta_over_full']:.2f} | {row['floor_seconds']:.3f} s | {row['delta_over_floor']:.2f} | "
                f"{row['delta_payload_bytes'] / mib:.1f} MiB | {choice['patched_tensors']} / "
                f"{choice['whole_tensors']} / {choice['untracked_tensors']}, {choice['chosen_whole_tensors']} |"
            )
        lines += [
            "",
            "What the delta refit does beyond the floor, each part timed alone in the policy process (seconds):",
            "",
            "| changed | floor (compare) | + baseline patched | + new version's digest | receiver: patch | "
            "receiver: patch + hash | receiver: patch + terms + audit | pair floor: sender's pass and receiver's "
            "at once | sender's delta time in the refit | receiver's |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in run["rows"]:
            parts = row["floor_parts_seconds"]
            lines.append(
                f"| {row['changed_fraction']:.2%} | {parts['floor']:.3f} | {parts['update']:.3f} | "
                f"{parts['digest']:.3f} | {parts['apply']:.3f} | {parts['apply_digest']:.3f} | "
                f"{parts['apply_terms']:.3f} | {parts['pair']:.3f} | "
                f"{row['delta_sender_delta_seconds']:.3f} | {row['delta_receiver_delta_seconds']:.3f} |"
            )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default=1 << 30)
    parser.add_argument("--elements-per-tensor", type=int, default=ELEMENTS_PER_TENSOR)
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=["gloo_cpu", "cuda_ipc"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--bucket-size", type=parse_size, default=32 << 20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--settle", type=int, default=6)
    parser.add_argument("--workload-hidden", type=int, default=1024)
    parser.add_argument("--workload-layers", type=int, default=4)
    parser.add_argument("--workload-steps", type=int, default=5)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--kernel-size", type=parse_size, default=128 << 20)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    tensors = max(1, args.size // (2 * args.elements_per_tensor))
    params = {"seed": 1, "tensors": tensors, "elements": args.elements_per_tensor}
    results = {
        "setup": {
            "size": 2 * tensors * args.elements_per_tensor,
            "tensors": tensors,
            "bucket_size": args.bucket_size,
            "reps": args.reps,
            "settle": args.settle,
            "fractions": args.fractions,
        },
        "workload": workload(args.workload_hidden, args.workload_layers, args.lrs, args.workload_steps),
        "kernels": kernels(args.kernel_size // 2, 0.01),
        "refits": [
            refits(backend, params, args.bucket_size, args.fractions, args.reps, args.settle)
            for backend in args.backends
        ],
    }
    table = report_table(results)
    write_results(args.out, "delta", results, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
