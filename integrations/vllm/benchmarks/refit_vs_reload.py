"""Refit into vLLM against what users do without ckpt-engine, side by side in one run.

    python integrations/vllm/benchmarks/refit_vs_reload.py [--reps 11] [--bucket-size 32MiB]

A random Qwen2 of about 124 MB (bf16) is served by vLLM's CPU build (tensor-parallel size 1);
a trainer process holds new weights W ready in memory for every repetition. For each backend
(``gloo_cpu``, and ``cuda_ipc`` with ``device="cpu"``), W goes into the running engine two
ways, alternating:

* ``ckpt_refit``: the trainer sends W while vLLM's worker receives it and streams it into the
  model (``RefitCoordinator`` over ``JoinedPool(trainer, vLLM)``, commit included);
* ``disk_reload``: the trainer saves W as safetensors (with the model's config) to a temporary
  folder, then vLLM's own ``reload_weights(weights_path=...)``, and its prefix cache reset.

After both, greedy tokens must be equal (the same W, the same engine). Also timed: vLLM's
reload of the W just saved, already in the page cache (its own load and post-load processing,
which every way in pays). Memory is measured first, before any disk reload: the worker's peak
RSS during its first refits over its RSS before them, against the bound two buckets + the
largest tensor + 64 MiB. Writes ``refit_vs_reload.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from scaffold import in_scratch, set_up_process, trainer_pool, write_results

from ckpt_core.orchestration.worker import RefitWorker

HERE = Path(__file__).resolve().parent
MODEL: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PROMPTS = [{"prompt_token_ids": [(5 * i + j) % 8000 + 1 for j in range(24)]} for i in range(2)]
MIB = 1 << 20


_READY: dict[int, list[tuple[str, torch.Tensor]]] = {}


def perturbed_weights(params: dict[str, Any], *, refit_index: int, rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """W for refit ``refit_index``: the start-up weights plus ``1e-3 * (refit_index + 1)``, made
    once per process and then ready in memory, as a trainer's weights are (a weights factory
    for ``RefitWorker``; the disk path saves the same tensors). Both methods move W; neither
    is timed making it."""
    from safetensors import safe_open

    if not _READY:  # every version at the first call (the untimed warm-up refit)
        with safe_open(os.path.join(params["model"], "model.safetensors"), framework="pt") as source:
            start = [(name, source.get_tensor(name).float()) for name in params["names"]]
        for index in range(params["versions"]):
            _READY[index] = [(name, (t + 1e-3 * (index + 1)).to(torch.bfloat16)) for name, t in start]
    yield from _READY[int(params.get("first_index", 0)) + refit_index]


def tensor_sizes(path: Path) -> list[int]:
    """Bytes of each tensor of a safetensors file (W has the start-up weights' shapes)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as source:
        return [source.get_tensor(name).nbytes for name in source.keys()]  # noqa: SIM118 - not a dict


def make_model(path: Path, layers: int) -> list[str]:
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**MODEL, "num_hidden_layers": layers})
    model = transformers.Qwen2ForCausalLM(config).bfloat16()
    model.save_pretrained(str(path))
    return list(model.state_dict())


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


class SavingTrainer(RefitWorker):
    """The trainer: a policy ``RefitWorker`` that can also save the W it holds to disk (the
    disk path's save runs where W lives, as a trainer's ``save_pretrained`` would)."""

    def save_weights(self, *, index: int, target: str, config: str) -> float:
        """Save W ``index`` (already in memory) with the model's config into ``target``;
        seconds."""
        from safetensors.torch import save_file

        weights = dict(_READY[index])  # made before the first refit, untimed
        start = time.perf_counter()
        os.mkdir(target)
        save_file(weights, os.path.join(target, "model.safetensors"))
        Path(target, "config.json").write_bytes(Path(config).read_bytes())
        return time.perf_counter() - start


def disk_reload(llm: Any, trainer: Any, params: dict[str, Any], index: int, workdir: Path) -> tuple[float, float]:
    """The trainer saves W ``index`` where vLLM can read it and vLLM reloads it from there;
    seconds end to end, and the trainer's save within them."""
    target = workdir / f"w{index}"
    start = time.perf_counter()
    (saved,) = trainer.call(
        [(0, "save_weights", {"index": index, "target": str(target), "config": f"{params['model']}/config.json"})],
        120.0,
    )
    if not saved.ok:
        raise RuntimeError(f"the trainer could not save W: {saved.describe()}")
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target), "is_checkpoint_format": True})
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    return time.perf_counter() - start, float(saved.value)


def cached_reload(llm: Any, refit_index: int, workdir: Path) -> float:
    """vLLM's reload of the W that :func:`disk_reload` just saved, now in the page cache: its
    load and post-load processing alone, which every way of putting W into vLLM pays."""
    start = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(workdir / f"w{refit_index}")})
    return time.perf_counter() - start


def run(backends: list[str], reps: int, memory_refits: int, bucket_size: int, layers: int, out: Path) -> dict[str, Any]:
    set_up_process()
    return in_scratch(
        "ckpt_vllm_bench_", lambda workdir: _run_in(workdir, backends, reps, memory_refits, bucket_size, layers, out)
    )


def _run_in(
    workdir: Path, backends: list[str], reps: int, memory_refits: int, bucket_size: int, layers: int, out: Path
) -> dict[str, Any]:
    from vllm import LLM

    from ckpt_vllm import VLLM_ENGINE_ARGS

    names = make_model(workdir / "start", layers)
    versions = len(backends) * (memory_refits + reps)
    params = {"model": str(workdir / "start"), "names": names, "versions": versions}
    sizes = tensor_sizes(workdir / "start" / "model.safetensors")
    llm = LLM(
        model=params["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        dtype="bfloat16",
        seed=0,
        **VLLM_ENGINE_ARGS,
    )
    results: dict[str, Any] = {
        "model_bytes": sum(sizes),
        "tensors": len(sizes),
        "largest_tensor_bytes": max(sizes),
        "bucket_size": bucket_size,
        "worker_peak_rss_bound_bytes": 2 * bucket_size + max(sizes) + 64 * MIB,
        "backends": {},
    }
    first_index = 0
    for backend in backends:
        results["backends"][backend] = run_backend(
            llm, backend, params, first_index, reps, memory_refits, bucket_size, workdir
        )
        results["backends"][backend]["memory_within_bound"] = (
            results["backends"][backend]["worker_peak_rss_growth_bytes"] <= results["worker_peak_rss_bound_bytes"]
        )
        first_index += memory_refits + reps
    llm.llm_engine.engine_core.shutdown()
    write_results(out, "refit_vs_reload", results, report_table(results))
    return results


def run_backend(
    llm: Any,
    backend: str,
    params: dict[str, Any],
    first_index: int,
    reps: int,
    memory_refits: int,
    bucket_size: int,
    workdir: Path,
) -> dict[str, Any]:
    """Memory first (before this backend's disk reloads touch the worker), then time."""
    from ckpt_core.orchestration.coordinator import RefitCoordinator
    from ckpt_core.orchestration.joined import JoinedPool
    from ckpt_vllm import VllmRollout, VllmWorkerPool

    engine_kwargs = {"device": "cpu"} if backend == "cuda_ipc" else {}
    rollout = VllmRollout(llm, backend=backend, bucket_size_bytes=bucket_size, engine_kwargs=engine_kwargs)
    rows: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    with trainer_pool(
        "refit_vs_reload:SavingTrainer",
        backend=backend,
        bucket_size=bucket_size,
        engine_kwargs=engine_kwargs,
        weights="refit_vs_reload:perturbed_weights",
        weights_params={**params, "first_index": first_index},
    ) as trainer:
        coordinator = RefitCoordinator(JoinedPool(trainer, VllmWorkerPool(rollout)), num_policy=1, num_rollout=1)
        coordinator.setup()

        def version() -> int:  # the W index the last refit sent
            return first_index + coordinator.weight_version - 1

        for _ in range(memory_refits):
            worker = coordinator.refit().rollout[0]
            memory.append({k: worker[k] for k in ("rss_before_bytes", "peak_rss_bytes", "wall_seconds")})
        disk_reload(llm, trainer, params, version(), workdir)  # the disk path's warm-up
        for rep in range(reps):  # the methods alternate, each moving the same new W in
            start = time.perf_counter()
            report = coordinator.refit()
            refit_seconds = time.perf_counter() - start
            refitted = greedy(llm)
            reload_seconds, save_seconds = disk_reload(llm, trainer, params, version(), workdir)
            reloaded = greedy(llm)
            load_seconds = cached_reload(llm, version(), workdir)
            if refitted != reloaded:
                raise AssertionError(
                    f"{backend} rep {rep}: the same W generates {refitted} refitted, {reloaded} reloaded"
                )
            worker = report.rollout[0]
            worker_seconds, wait_seconds = worker["wall_seconds"], worker["receive_wait_seconds"]
            print(
                f"{backend} rep {rep}: refit {refit_seconds:.3f}s (vLLM worker {worker_seconds:.3f}s, "
                f"{wait_seconds:.3f}s of it waiting for bytes), "
                f"disk reload {reload_seconds:.3f}s ({save_seconds:.3f}s of it saving), "
                f"vLLM's load alone {load_seconds:.3f}s",
                flush=True,
            )
            rows.append(
                {
                    "ckpt_refit_s": refit_seconds,
                    "worker_s": worker_seconds,
                    "worker_wait_s": wait_seconds,
                    "worker_cloned_bytes": worker["pending_cloned_bytes"],
                    "disk_reload_s": reload_seconds,
                    "disk_save_s": save_seconds,
                    "vllm_load_s": load_seconds,
                }
            )
        coordinator.finalize()
    refit_s = statistics.median(r["ckpt_refit_s"] for r in rows)
    reload_s = statistics.median(r["disk_reload_s"] for r in rows)
    resident = memory[0]["rss_before_bytes"]
    return {
        "reps": rows,
        "median_ckpt_refit_s": refit_s,
        "median_disk_reload_s": reload_s,
        "median_vllm_load_alone_s": statistics.median(r["vllm_load_s"] for r in rows),
        "median_worker_wait_s": statistics.median(r["worker_wait_s"] for r in rows),
        "median_disk_save_s": statistics.median(r["disk_save_s"] for r in rows),
        "speedup": reload_s / refit_s,
        "memory_refits": memory,
        "worker_rss_before_first_refit_bytes": resident,
        "worker_peak_rss_growth_bytes": max(m["peak_rss_bytes"] for m in memory) - resident,
    }


def report_table(r: dict[str, Any]) -> str:
    lines = [
        f"Refit into vLLM (CPU build, TP 1): {r['model_bytes'] / 1e6:.0f} MB in {r['tensors']} tensors, "
        f"{r['bucket_size'] // MIB} MiB buckets; medians of {len(next(iter(r['backends'].values()))['reps'])} "
        "alternating repetitions, seconds.",
        "",
        "| backend | ckpt-engine refit (worker waiting for bytes) "
        "| save to disk + vLLM `reload_weights(weights_path=...)` (saving) | speed-up "
        "| vLLM's load alone (W in the page cache) | worker peak RSS over resident (bound) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    bound = r["worker_peak_rss_bound_bytes"] / MIB
    for backend, b in r["backends"].items():
        lines.append(
            f"| {backend} | {b['median_ckpt_refit_s']:.3f} ({b['median_worker_wait_s']:.3f}) "
            f"| {b['median_disk_reload_s']:.3f} ({b['median_disk_save_s']:.3f}) | {b['speedup']:.2f}x "
            f"| {b['median_vllm_load_alone_s']:.3f} | {b['worker_peak_rss_growth_bytes'] / MIB:.0f} MiB "
            f"({bound:.0f}: {'within' if b['memory_within_bound'] else 'OVER'}) |"
        )
    lines += [
        "",
        "The bound is the issue's: two buckets + the largest tensor + 64 MiB over the worker's RSS before its",
        "first refit (model and buffers resident), taken over its first refits, before any disk reload.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ckpt_core.cli import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["gloo_cpu", "cuda_ipc"], choices=["gloo_cpu", "cuda_ipc"])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--memory-refits", type=int, default=3, help="refits measured for memory, first")
    parser.add_argument("--bucket-size", type=parse_size, default=32 * MIB)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (22 MB each; 4: a 124 MB model)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    results = run(args.backends, args.reps, args.memory_refits, args.bucket_size, args.layers, args.out)
    print(report_table(results))
    return 0 if all(b["memory_within_bound"] for b in results["backends"].values()) else 1


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    sys.exit(main())
