"""A LoRA adapter into a running vLLM three ways, side by side in one run: an adapter refit
served from memory, against saving the adapter and vLLM's own load of it from disk, and
against merging it into the weights and refitting the whole model.

    python integrations/vllm/benchmarks/lora_refit.py [--reps 11] [--rank 16]

A random Qwen2 of about 124 MB (bf16) is served by vLLM's CPU build at tensor-parallel size 1
with LoRA enabled. The trainer is a process of its own, as an RL framework's is
(:class:`adapter_trainer.AdapterTrainer`, started by the local launcher, with an engine of its
own: ``--backend`` gloo_cpu, or cuda_ipc with ``device="cpu"``). The adapter
targets every linear layer of every decoder layer (q, k, v, o, gate, up, down) at rank
``--rank``, fp32 as PEFT keeps it; two versions of it, A and B, alternate so every load changes
it (the trainer and this process make the same two from one seed). After ``WARMUP`` adapter
refits, timed apart (new memory faults in under them), each repetition times, after 1.5 s with
the engine idle:

* ``refit``: the trainer sends the adapter's tensors while ``VllmRollout.refit_adapter``
  receives them and every rank serves them from memory (``ckpt_vllm.model.lora``), both
  starting at one ``time.perf_counter`` stamp (one clock for every process of a machine);
* ``disk``: the adapter is written as PEFT writes it (``adapter_config.json`` and
  ``adapter_model.safetensors``, from this process's copy of it) and vLLM loads it
  (``llm_engine.add_lora`` with ``load_inplace``, what ``/v1/load_lora_adapter`` does), both timed;

then checks that both serve the same greedy tokens. The rank's own account of each refit splits
it into receiving, holding (the checks) and installing (vLLM's load of the held tensors); its
call's stamps give the call's way to the rank and back, and the trainer's when its send returned. After
the repetitions: ``call`` times vLLM's engine call to its workers alone (``check_health``, which
does nothing), the floor under both ways, alternating with the same call beside the trainer's own
work (``AdapterTrainer.pack``: the adapter copied into a buffer, as a sender packs it, from the
moment the call starts: what sharing the machine's cores with a trainer costs vLLM's call);
then, with the adapters removed, ``merged`` times merging the adapter into the weights
(``W + B A alpha / r``, cast to bf16) and a full refit of the model. Last, ``transport floor``:
the backend's raw transport moving the adapter's bytes between two processes, plus one round trip
(:func:`ckpt_core.bench.baselines.small_refit_floor`).
Reported: bytes, medians, the ratios disk / refit and merged / refit, and the refit against
what it cannot do without, vLLM's call and its own install plus the transport floor (issue 50's
goal: within 1.3x). Writes ``lora_refit.json`` and ``.md`` into ``--out``; exits 1 unless that
goal holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from adapter_trainer import TARGETS, VERSIONS, adapter_versions, base_weights  # noqa: E402
from http_vs_offline import MAX_TOKENS, PROMPTS  # noqa: E402
from refit_vs_reload import MODEL, make_model  # noqa: E402
from scaffold import in_scratch, set_up_process, trainer_pool, write_results  # noqa: E402

MIB = 1 << 20
GOAL = 3.0  # disk / refit, issue 35's (not met: what bounds it is below)
FLOOR_GOAL = 1.3  # refit / (vLLM's call + its install + the transport floor), issue 50's
IDLE_S = 1.5
WARMUP = 5
"""Adapter refits before the timed ones, timed apart: the first, then one into each block a Gloo
slot makes for its rotation (four, while vLLM's worker keeps the adapter version it served
before beside the one it serves: ``ckpt_core._internal.slot_memory``), memory new to the
process, which faults in under the transfer."""


def run(reps: int, rank: int, bucket_size: int, out: Path, backend: str = "gloo_cpu") -> dict[str, Any]:
    set_up_process()
    results = in_scratch("ckpt_vllm_lora_bench_", lambda workdir: _run_in(workdir, reps, rank, bucket_size, backend))
    # Another backend is another result: it does not overwrite gloo_cpu's.
    write_results(
        out, "lora_refit" if backend == "gloo_cpu" else f"lora_refit_{backend}", results, report_table(results)
    )
    return results


def alongside(trainer: Any, method: str, kwargs: dict[str, Any], here: Callable[[], Any]) -> Any:
    """The trainer's ``method`` (a call into its process, from a thread) while ``here`` runs on
    this thread: what the trainer's call returned."""
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.extend(trainer.call([(0, method, kwargs)], 600)))
    thread.start()
    try:
        here()
    finally:
        thread.join(600)
    if not answers:
        raise RuntimeError(f"the trainer's {method} did not answer within 600 s")
    return _answer(answers)


def timed(trainer: Any, method: str, kwargs: dict[str, Any], receive: Callable[[], Any]) -> tuple[Any, float, float]:
    """The trainer's ``method`` (given ``start_at``) and the rollout's ``receive``, both starting
    at one stamp ``IDLE_S`` from now, the engine idle until then: ``(what the trainer's call
    returned, seconds from that stamp to the end of receive, the stamp)``."""
    start_at = time.perf_counter() + IDLE_S
    ended: list[float] = []

    def receiving() -> None:
        time.sleep(max(0.0, start_at - time.perf_counter()))
        receive()
        ended.append(time.perf_counter())

    value = alongside(trainer, method, {**kwargs, "start_at": start_at}, receiving)
    return value, ended[0] - start_at, start_at


def _run_in(workdir: Path, reps: int, rank: int, bucket_size: int, backend: str) -> dict[str, Any]:
    from safetensors.torch import save_file
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from ckpt_vllm import VLLM_ENGINE_ARGS, VllmRollout

    make_model(workdir / "start", MODEL["num_hidden_layers"])
    base = base_weights(str(workdir / "start"))
    versions = adapter_versions(base, rank)  # the trainer makes the same (a seeded generator)
    alpha = 2 * rank
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(sum(TARGETS.values(), ())),
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    llm = LLM(
        model=str(workdir / "start"),
        enforce_eager=True,
        max_model_len=128,
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        enable_lora=True,
        max_lora_rank=rank,
        max_loras=2,
        **VLLM_ENGINE_ARGS,
    )
    engine_kwargs = {"device": "cpu"} if backend == "cuda_ipc" else {}
    rollout = VllmRollout(llm, backend=backend, bucket_size_bytes=bucket_size, engine_kwargs=engine_kwargs)
    with trainer_pool(
        "adapter_trainer:AdapterTrainer",
        backend=backend,
        bucket_size=bucket_size,
        engine_kwargs=engine_kwargs,
        weights="adapter_trainer:adapter_weights",
        weights_params={"model": str(workdir / "start"), "lora_rank": rank},
    ) as trainer:
        try:
            metadata = [_answer(trainer.call([(0, "prepare", {})], 120)), *rollout.prepare()]
            sizes: dict[str, Any] = {"train_world_size": 1, "rollout_world_size": 1, "metadata": metadata}
            alongside(trainer, "init", sizes, lambda: rollout.init(**sizes))
            rows: list[dict[str, Any]] = []
            warmup: list[float] = []
            for rep in range(-WARMUP, reps):
                version = VERSIONS[rep % 2]
                reports: list[dict[str, Any]] = []

                def receive(reports: list[dict[str, Any]] = reports) -> None:
                    reports.extend(rollout.refit_adapter("refit", lora_id=1, config=config))

                sent, seconds, start_at = timed(trainer, "send_adapter", {"version": version}, receive)
                row: dict[str, Any] = {"version": version, "refit_s": seconds}
                row["worker_s"] = reports[0]["seconds"]
                # One clock for the machine's processes: the call's way to the rank and back.
                row["call_in_s"] = reports[0]["started_at"] - start_at
                row["call_out_s"] = start_at + seconds - reports[0]["ended_at"]
                row["trainer_s"] = sent["ended_at"] - start_at
                row["adapter_bytes"] = sent["payload_bytes"]

                def from_disk(path: Path = workdir / f"disk-{rep}", adapter: list[Any] = versions[version]) -> None:
                    path.mkdir()
                    (path / "adapter_config.json").write_text(json.dumps(config))
                    save_file({n: t.contiguous() for n, t in adapter}, str(path / "adapter_model.safetensors"))
                    llm.llm_engine.add_lora(LoRARequest("disk", 2, str(path), load_inplace=True))

                time.sleep(IDLE_S)
                started = time.perf_counter()
                from_disk()
                row["disk_s"] = time.perf_counter() - started
                memory = tokens_with(llm, rollout.lora_request("refit"))
                disk = tokens_with(llm, LoRARequest("disk", 2, str(workdir / f"disk-{rep}")))
                if memory != disk:
                    raise AssertionError(f"rep {rep}: the adapter from memory and from disk generate other tokens")
                if rep >= 0:
                    rows.append(row)
                    print(f"rep {rep}: refit {row['refit_s']:.3f} s, disk {row['disk_s']:.3f} s", flush=True)
                else:
                    warmup.append(row["refit_s"])
            calls, beside = [], []
            for rep in range(reps):  # alternating: vLLM's call alone, then beside the trainer's pack
                time.sleep(IDLE_S)
                started = time.perf_counter()
                llm.collective_rpc("check_health")
                calls.append(time.perf_counter() - started)
                packing = {"version": VERSIONS[rep % 2]}
                beside.append(timed(trainer, "pack", packing, lambda: llm.collective_rpc("check_health"))[1])
            rollout.remove_adapter("refit")
            llm.llm_engine.remove_lora(2)
            merged_rows = []
            for rep in range(-1, max(3, reps // 3)):
                kwargs = {"version": VERSIONS[rep % 2], "scaling": alpha / rank}
                sent, seconds, _ = timed(trainer, "send_merged", kwargs, rollout.refit)
                merged_bytes = int(sent["payload_bytes"])
                if rep >= 0:
                    merged_rows.append({"merged_s": seconds, "merge_s": sent["merge_s"]})
                    print(f"merged rep {rep}: {seconds:.3f} s (merging {sent['merge_s']:.3f} s)", flush=True)
        finally:
            trainer.call([(0, "finalize", {})], 60)
            rollout.finalize()
            llm.llm_engine.engine_core.shutdown()
    from ckpt_core.bench.baselines import small_refit_floor

    floors = small_refit_floor(backend, adapter_bytes_sent(rows), reps)
    median = {
        key: statistics.median(r[key] for r in rows)
        for key in ("refit_s", "disk_s", "call_in_s", "call_out_s", "trainer_s")
    }
    median |= {key: statistics.median(r[key] for r in merged_rows) for key in ("merged_s", "merge_s")}
    median["call_s"] = statistics.median(calls)
    median["call_beside_pack_s"] = statistics.median(beside)
    median["floor_s"] = statistics.median(floors)
    worker = {phase: statistics.median(r["worker_s"][phase] for r in rows) for phase in rows[0]["worker_s"]}
    bound = median["call_s"] + worker["install"] + median["floor_s"]
    adapter_bytes = rows[-1]["adapter_bytes"]
    return {
        "model_bytes": sum(t.nbytes for t in base.values()),
        "rank": rank,
        "adapter_tensors": len(versions["A"]),
        "adapter_bytes": adapter_bytes,
        "merged_bytes": merged_bytes,
        "bucket_size": bucket_size,
        "backend": backend,
        "reps": rows,
        "warmup_refit_s": warmup,
        "merged_reps": merged_rows,
        "call_reps": calls,
        "call_beside_pack_reps": beside,
        "floor_reps": floors,
        "median": median,
        "median_worker_s": worker,
        "disk_over_refit": median["disk_s"] / median["refit_s"],
        "merged_over_refit": median["merged_s"] / median["refit_s"],
        "refit_over_bound": median["refit_s"] / bound,
        "over_goal_s": median["refit_s"] - FLOOR_GOAL * bound,
        "goal": GOAL,
        "disk_goal_met": median["disk_s"] / median["refit_s"] >= GOAL,
        "floor_goal": FLOOR_GOAL,
        "goal_met": median["refit_s"] / bound <= FLOOR_GOAL,
    }


def adapter_bytes_sent(rows: list[dict[str, Any]]) -> int:
    """The adapter's bytes as the refits moved them (every refit moves the same)."""
    return int(rows[-1]["adapter_bytes"])


def _answer(results: list[Any]) -> Any:
    """The value of the one call in ``results`` (a pool's answer), or its error raised."""
    (result,) = results
    if not result.ok:
        raise RuntimeError(result.describe())
    return result.value


def tokens_with(llm: Any, request: Any) -> list[list[int]]:
    """Greedy tokens of the benchmark's prompts with adapter ``request`` (prefix cache reset)."""
    from vllm import SamplingParams

    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


WARMUP_WHY = " (the first, then each into a block new to its Gloo slot's rotation, faulting in under the transfer)"


def report_table(r: dict[str, Any]) -> str:
    m, w = r["median"], r["median_worker_s"]
    return (
        f"A LoRA adapter into vLLM (CPU build, TP 1, {r['backend']}): rank {r['rank']} on every linear layer of a "
        f"{r['model_bytes'] / 1e6:.0f} MB bf16 Qwen2, {r['adapter_tensors']} tensors; medians of {len(r['reps'])} "
        f"(merged: {len(r['merged_reps'])}).\n\n"
        "| | bytes | time |\n| --- | --- | --- |\n"
        f"| adapter refit, served from memory | {r['adapter_bytes'] / 1e6:.2f} MB | {m['refit_s']:.3f} s |\n"
        f"| adapter saved, vLLM loads it from disk | {r['adapter_bytes'] / 1e6:.2f} MB written "
        f"| {m['disk_s']:.3f} s |\n"
        f"| merged into the weights, full refit | {r['merged_bytes'] / 1e6:.1f} MB | {m['merged_s']:.3f} s "
        f"(merging {m['merge_s']:.3f} s) |\n\n"
        f"The {len(r['warmup_refit_s'])} refits before these took "
        f"{', '.join(f'{s * 1e3:.0f}' for s in r['warmup_refit_s'])} ms"
        f"{WARMUP_WHY if r['backend'] == 'gloo_cpu' else ''}.\n\n"
        f"Disk / refit: {r['disk_over_refit']:.2f}x (goal >= {GOAL}); merged / refit: {r['merged_over_refit']:.2f}x "
        f"in time, {r['merged_bytes'] / r['adapter_bytes']:.0f}x in bytes.\n\n"
        f"Where a refit's time goes: the rank received the adapter in {w['receive'] * 1e3:.1f} ms, checked and "
        f"held it in {w['hold'] * 1e3:.1f} ms and installed it through vLLM's own load in "
        f"{w['install'] * 1e3:.1f} ms; vLLM's engine call to its worker alone (`check_health`) took "
        f"{m['call_s'] * 1e3:.1f} ms. During a refit the call reached the rank {m['call_in_s'] * 1e3:.1f} ms after "
        f"the start and its answer the driver {m['call_out_s'] * 1e3:.1f} ms after the rank's end; the trainer's "
        f"send returned {m['trainer_s'] * 1e3:.1f} ms after the start. The goal leaves "
        f"{m['disk_s'] / GOAL * 1e3:.1f} ms (disk / {GOAL:g}); the call "
        f"and vLLM's install (the same load the disk path runs, from the file) take "
        f"{(m['call_s'] + w['install']) * 1e3:.1f} ms.\n\n"
        f"Against what a refit cannot do without: vLLM's call ({m['call_s'] * 1e3:.1f} ms), its install "
        f"({w['install'] * 1e3:.1f} ms) and the transport floor (the adapter's bytes and a round trip over "
        f"{r['backend']}'s raw transport, {m['floor_s'] * 1e3:.2f} ms): {r['refit_over_bound']:.2f}x "
        f"(goal <= {r['floor_goal']}: {'met' if r['goal_met'] else 'missed'}).\n\n"
        f"The same call timed beside the trainer's own work (from the moment the call starts, the trainer copies the "
        f"adapter into a buffer of its process, as it packs a bucket; alternating with the call alone): "
        f"{m['call_beside_pack_s'] * 1e3:.1f} ms, {(m['call_beside_pack_s'] - m['call_s']) * 1e3:.1f} ms more than "
        f"alone, which the three above do not count. The refit is {abs(r['over_goal_s']) * 1e3:.1f} ms "
        f"{'over' if r['over_goal_s'] > 0 else 'within'} the goal.\n"
    )


def main(argv: list[str] | None = None) -> int:
    from ckpt_core.cli import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--backend", default="gloo_cpu", choices=["gloo_cpu", "cuda_ipc"])
    parser.add_argument("--bucket-size", type=parse_size, default=32 * MIB)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    results = run(args.reps, args.rank, args.bucket_size, args.out, args.backend)
    print(report_table(results))
    return 0 if results["goal_met"] else 1


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    sys.exit(main())
