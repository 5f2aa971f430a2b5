"""A refit through ``vllm serve`` over HTTP against the offline ``LLM``, and both against vLLM's own
load of the same weights already in memory, side by side in one run.

    python integrations/vllm/benchmarks/http_vs_offline.py [--reps 11] [--bucket-size 32MiB]

A random Qwen2 of about 124 MB (bf16) is served twice by vLLM's CPU build at tensor-parallel
size 1, both engines selecting the ckpt backend: a ``vllm serve`` subprocess on loopback, and an
offline ``LLM`` in this process. This process is also the trainer: two versions of the weights,
A and B, ready in memory (bf16), alternate so every refit changes the model. For each backend
(``gloo_cpu``, and ``cuda_ipc`` with ``device="cpu"``), each repetition times, in turn:

* ``http_refit``: ``CkptTrainerWeightTransferEngine.send_weights`` through vLLM's own
  ``HTTPVLLMWeightSyncClient`` (``/start_weight_update``, ``/update_weights`` while the trainer
  sends, ``/finish_weight_update`` with a version);
* ``offline_refit``: the same trainer engine code through the ``LLM``'s offline calls (the
  calls vLLM's Ray client makes on ``LLM`` actors, made here in process);
* ``memory_load``: vLLM's ``reload_weights(weights_iterator=...)`` in the offline engine's
  worker, of the same version held there in memory (its layerwise reload, what a refit streams
  into), timed from this process around the ``collective_rpc`` as the refits are.

Beside each wall time, the CPU seconds spent on it by this process (the trainer) and by the
worker's process (every thread: the transport's copies as well as vLLM's load), which bound how
fast it can be on this machine's CPUs. Every refit and load is followed by greedy tokens, which
must equal that engine's own reload of the version from disk (an error otherwise). Writes
``http_vs_offline.json`` and ``.md`` into ``--out``; exits 1 unless the goals hold: HTTP within
1.2x of offline, each refit within 1.3x of the memory load. Each timed call starts after 1.5 s
with both engines idle (vLLM's processes spin for a second after each call, and both engines
share a core here).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from refit_vs_reload import MODEL, make_model  # noqa: E402 - the sibling benchmark's model
from scaffold import in_scratch, set_up_process, write_results  # noqa: E402

from ckpt_vllm.driver.rollout import WORKER_EXTENSION  # noqa: E402
from ckpt_vllm.weight_transfer.extension import CkptEngineWorkerExtension  # noqa: E402

MIB = 1 << 20
PROMPTS = [[(5 * i + j) % 8000 + 1 for j in range(24)] for i in range(2)]
MAX_TOKENS = 8
VERSIONS = ("A", "B")
HTTP_GOAL, MEMORY_GOAL = 1.2, 1.3
CALL_TIMEOUT_S = 300.0
IDLE_S = 1.5

_HELD: dict[str, list[tuple[str, torch.Tensor]]] = {}  # in the offline engine's worker


class HeldWeights(CkptEngineWorkerExtension):
    """ckpt-vllm's worker extension (for the report of each refit), and weights held in the
    worker's memory with vLLM's own in-place reload of them (``model_runner.reload_weights``)."""

    model_runner: Any

    def hold_weights(self, paths: dict[str, str]) -> int:
        """Read each version's safetensors into memory (untimed); the bytes held."""
        from safetensors.torch import load_file

        for version, path in paths.items():
            _HELD[version] = list(load_file(os.path.join(path, "model.safetensors")).items())
        return sum(t.nbytes for weights in _HELD.values() for _, t in weights)

    def load_held_weights(self, version: str) -> tuple[float, float]:
        """vLLM's reload of ``version`` from this worker's memory; seconds in the worker, and
        its process's CPU seconds."""
        start, cpu_start = time.perf_counter(), time.process_time()
        self.model_runner.reload_weights(weights_iterator=iter(_HELD[version]), is_checkpoint_format=True)
        return time.perf_counter() - start, time.process_time() - cpu_start


class OfflineClient:
    """vLLM's weight-sync client calls (those ``HTTPVLLMWeightSyncClient`` posts) made on an
    ``LLM`` in this process, as vLLM's Ray client makes them on ``LLM`` actors."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)


def make_versions(start: Path, workdir: Path) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """A and B: the start-up weights plus 1e-3 and 2e-3, in bf16, each also saved (with the
    model's config) where vLLM can reload it from disk."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(start / "model.safetensors"), framework="pt") as source:
        names = list(source.keys())  # noqa: SIM118 - not a dict
        base = {name: source.get_tensor(name).float() for name in names}
    versions = {}
    for k, version in enumerate(VERSIONS):
        weights = [(name, (base[name] + 1e-3 * (k + 1)).to(torch.bfloat16)) for name in names]
        target = workdir / version
        target.mkdir()
        save_file(dict(weights), str(target / "model.safetensors"))
        shutil.copy(start / "config.json", target / "config.json")
        versions[version] = weights
    return versions


class Server:
    """The HTTP engine: greedy tokens through ``/v1/completions``, vLLM's reload from disk."""

    def __init__(self, url: str) -> None:
        self.url = url

    def post(self, route: str, body: Any = None) -> Any:
        import requests

        response = requests.post(f"{self.url}/{route}", json=body, timeout=CALL_TIMEOUT_S)
        response.raise_for_status()
        return response.json() if response.content else None

    def tokens(self) -> list[list[int]]:
        self.post("reset_prefix_cache")
        body = {
            "model": "tiny",
            "prompt": PROMPTS,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        }
        choices = sorted(self.post("v1/completions", body)["choices"], key=lambda c: c["index"])
        return [list(c["token_ids"]) for c in choices]

    def reload(self, path: Path) -> None:
        kwargs = {"weights_path": str(path), "is_checkpoint_format": True}
        self.post("collective_rpc", {"method": "reload_weights", "kwargs": kwargs})


def offline_tokens(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def timed(call: Callable[[], Any]) -> float:
    # Both engines idle first: both share a core here, and after each call vLLM's processes
    # spin for a while (a worker polls its RPC queue for 1 s after each read, shm_broadcast's
    # busy_loop_s; OpenMP threads spin after a step). Measured: the first call into one engine
    # right after the other generated took about 0.9 s longer.
    time.sleep(IDLE_S)
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def timed_on_cpu(call: Callable[[], Any], row: dict[str, Any], method: str) -> float:
    """:func:`timed`, and the CPU seconds of this process (the trainer's, every thread) into
    ``row`` (the idle wait before costs none)."""
    cpu_start = time.process_time()
    seconds = timed(call)
    row[f"{method}_trainer_cpu_s"] = time.process_time() - cpu_start
    return seconds


def run(backends: list[str], reps: int, bucket_size: int, layers: int, out: Path) -> dict[str, Any]:
    set_up_process()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])  # HeldWeights
    results = in_scratch("ckpt_vllm_http_bench_", lambda workdir: _run_in(workdir, backends, reps, bucket_size, layers))
    write_results(out, "http_vs_offline", results, report_table(results))
    return results


def _run_in(workdir: Path, backends: list[str], reps: int, bucket_size: int, layers: int) -> dict[str, Any]:
    from vllm import LLM

    from ckpt_vllm.devtools.serve import local_vllm_serve

    make_model(workdir / "start", layers)
    versions = make_versions(workdir / "start", workdir)
    common = {"enforce_eager": True, "max_model_len": 128, "dtype": "bfloat16", "seed": 0}
    args = ["--served-model-name", "tiny", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "128"]
    args += ["--dtype", "bfloat16", "--seed", "0", "--worker-extension-cls", WORKER_EXTENSION]
    env = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    with local_vllm_serve(workdir / "start", log_path=workdir / "serve.log", args=args, env=env) as url:
        server = Server(url)
        llm = LLM(
            model=str(workdir / "start"),
            skip_tokenizer_init=True,
            worker_extension_cls="http_vs_offline.HeldWeights",
            weight_transfer_config={"backend": "ckpt"},
            **common,
        )
        try:
            (held,) = llm.collective_rpc("hold_weights", args=({v: str(workdir / v) for v in VERSIONS},))
            expected: dict[str, dict[str, list[list[int]]]] = {"http": {}, "offline": {}}
            for version in VERSIONS:  # each engine's own reload of each version from disk
                server.reload(workdir / version)
                expected["http"][version] = server.tokens()
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(workdir / version)})
                expected["offline"][version] = offline_tokens(llm)
            if expected["http"]["A"] == expected["http"]["B"]:
                raise RuntimeError("A and B generate the same tokens: the checks could not tell them apart")
            results: dict[str, Any] = {
                "model_bytes": sum(t.nbytes for _, t in versions["A"]),
                "tensors": len(versions["A"]),
                "bucket_size": bucket_size,
                "held_in_worker_bytes": held,
                "cpus": len(os.sched_getaffinity(0)),
                "goals": {"http_over_offline": HTTP_GOAL, "refit_over_memory_load": MEMORY_GOAL},
                "backends": {},
            }
            for backend in backends:
                results["backends"][backend] = run_backend(llm, server, versions, expected, backend, reps, bucket_size)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return results


def run_backend(
    llm: Any,
    server: Server,
    versions: dict[str, list[tuple[str, torch.Tensor]]],
    expected: dict[str, dict[str, list[list[int]]]],
    backend: str,
    reps: int,
    bucket_size: int,
) -> dict[str, Any]:
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo

    kwargs = {"device": "cpu"} if backend == "cuda_ipc" else {}
    info: dict[str, Any] = {"transport": backend, "bucket_size_bytes": bucket_size, "engine_kwargs": kwargs}
    engines = {
        "http": WeightTransferTrainerFactory.trainer_init(
            CkptTrainerInitInfo(rank=0, **info), client=HTTPVLLMWeightSyncClient(server.url)
        ),
        "offline": WeightTransferTrainerFactory.trainer_init(
            CkptTrainerInitInfo(rank=0, **info), client=OfflineClient(llm)
        ),
    }
    tokens = {"http": server.tokens, "offline": lambda: offline_tokens(llm)}

    def memory_load(version: str, row: dict[str, Any]) -> float:
        in_worker: list[tuple[float, float]] = []
        seconds = timed_on_cpu(
            lambda: in_worker.extend(llm.collective_rpc("load_held_weights", args=(version,))), row, "memory_load"
        )
        row.update(memory_load_worker_s=in_worker[0][0], memory_load_worker_cpu_s=in_worker[0][1])
        return seconds

    def offline_refit(version: str, row: dict[str, Any]) -> float:
        seconds = timed_on_cpu(
            lambda: engines["offline"].send_weights(versions[version], weight_version=version), row, "offline_refit"
        )
        (report,) = llm.collective_rpc("ckpt_engine_report")  # the worker's side of it
        row.update(offline_worker_s=report["result"]["wall_seconds"])
        row.update(offline_refit_worker_cpu_s=report["result"]["cpu_seconds"])
        row.update(offline_worker_wait_s=report["result"]["receive_wait_seconds"])
        return seconds

    def http_refit(version: str, row: dict[str, Any]) -> float:
        seconds = timed_on_cpu(
            lambda: engines["http"].send_weights(versions[version], weight_version=version), row, "http_refit"
        )
        (report,) = server.post("collective_rpc", {"method": "ckpt_engine_report"})["results"]
        row.update(http_worker_s=report["result"]["wall_seconds"])
        row.update(http_refit_worker_cpu_s=report["result"]["cpu_seconds"])
        row.update(http_worker_wait_s=report["result"]["receive_wait_seconds"])
        return seconds

    methods: dict[str, Callable[[str, dict[str, Any]], float]] = {
        "http_refit": http_refit,
        "offline_refit": offline_refit,
        "memory_load": memory_load,
    }
    engine_of = {"http_refit": "http", "offline_refit": "offline", "memory_load": "offline"}
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(-1, reps):  # rep -1: the warm-up, untimed
            version = VERSIONS[rep % 2]
            order = list(methods)[rep % 3 :] + list(methods)[: rep % 3]  # each goes first in turn
            row: dict[str, Any] = {"version": version}
            for method in order:
                row[f"{method}_s"] = methods[method](version, row)
                engine = engine_of[method]
                if tokens[engine]() != expected[engine][version]:
                    raise AssertionError(f"{backend} rep {rep}: after {method} of {version} the tokens differ")
            if rep >= 0:
                rows.append(row)
                print(f"{backend} rep {rep}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "version"))
    finally:
        for engine in engines.values():
            engine.shutdown()
        server.post("shutdown_weight_transfer_engine")
        llm.shutdown_weight_transfer_engine()
    median = {m: statistics.median(r[f"{m}_s"] for r in rows) for m in methods}
    for part in ("http_worker", "http_worker_wait", "offline_worker", "offline_worker_wait", "memory_load_worker"):
        median[part] = statistics.median(r[f"{part}_s"] for r in rows)
    for method in methods:
        for side in ("trainer", "worker"):
            median[f"{method}_{side}_cpu"] = statistics.median(r[f"{method}_{side}_cpu_s"] for r in rows)
    ratios = {
        "http_over_offline": median["http_refit"] / median["offline_refit"],
        "http_over_memory_load": median["http_refit"] / median["memory_load"],
        "offline_over_memory_load": median["offline_refit"] / median["memory_load"],
    }
    return {
        "reps": rows,
        "median_s": median,
        "ratios": ratios,
        "goals_met": {
            "http_over_offline": ratios["http_over_offline"] <= HTTP_GOAL,
            "refit_over_memory_load": max(ratios["http_over_memory_load"], ratios["offline_over_memory_load"])
            <= MEMORY_GOAL,
        },
    }


def report_table(r: dict[str, Any]) -> str:
    reps = len(next(iter(r["backends"].values()))["reps"])
    lines = [
        f"vLLM's weight-transfer API (CPU build, TP 1): {r['model_bytes'] / 1e6:.0f} MB in {r['tensors']} tensors, "
        f"{r['bucket_size'] // MIB} MiB buckets; medians of {reps} repetitions, seconds.",
        "",
        "| backend | `vllm serve` over HTTP | offline `LLM` | vLLM's load from memory "
        f"| HTTP / offline (goal {HTTP_GOAL}) | HTTP / memory, offline / memory (goal {MEMORY_GOAL}) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for backend, b in r["backends"].items():
        m, q = b["median_s"], b["ratios"]
        lines.append(
            f"| {backend} | {m['http_refit']:.3f} | {m['offline_refit']:.3f} | {m['memory_load']:.3f} "
            f"| {q['http_over_offline']:.2f}x | {q['http_over_memory_load']:.2f}x, "
            f"{q['offline_over_memory_load']:.2f}x |"
        )
    lines += [
        "",
        "In the worker (its own clock; the rest of each refit is vLLM's calls reaching it and answering):",
        "",
        "| backend | server's worker (waiting for bytes) | offline worker (waiting for bytes) "
        "| vLLM's load from memory |",
        "| --- | --- | --- | --- |",
    ]
    for backend, b in r["backends"].items():
        m = b["median_s"]
        lines.append(
            f"| {backend} | {m['http_worker']:.3f} ({m['http_worker_wait']:.3f}) "
            f"| {m['offline_worker']:.3f} ({m['offline_worker_wait']:.3f}) | {m['memory_load_worker']:.3f} |"
        )
    cores = r.get("cpus")
    lines += [
        "",
        f"CPU seconds of each (the trainer's process, the worker's process; every thread; {cores} CPUs here), and "
        "the least time they take on these CPUs (their sum over the CPU count):",
        "",
        "| backend | `vllm serve` over HTTP | offline `LLM` | vLLM's load from memory |",
        "| --- | --- | --- | --- |",
    ]
    for backend, b in r["backends"].items():
        m = b["median_s"]
        cells = []
        for method in ("http_refit", "offline_refit", "memory_load"):
            trainer, worker = m[f"{method}_trainer_cpu"], m[f"{method}_worker_cpu"]
            cells.append(f"{trainer:.3f} + {worker:.3f} (>= {(trainer + worker) / cores:.3f})")
        lines.append(f"| {backend} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from ckpt_core.cli import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["gloo_cpu", "cuda_ipc"], choices=["gloo_cpu", "cuda_ipc"])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--bucket-size", type=parse_size, default=32 * MIB)
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"], help="decoder layers (22 MB each)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    results = run(args.backends, args.reps, args.bucket_size, args.layers, args.out)
    print(report_table(results))
    return 0 if all(all(b["goals_met"].values()) for b in results["backends"].values()) else 1


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    sys.exit(main())
