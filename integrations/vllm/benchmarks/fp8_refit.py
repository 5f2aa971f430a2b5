"""A refit into an FP8 vLLM two ways, side by side in one run: the trainer sends BF16 and vLLM
quantizes on load, against the trainer quantizing on send.

    python integrations/vllm/benchmarks/fp8_refit.py [--reps 11] [--bucket-size 32MiB]

A random Qwen2 of about 124 MB (bf16) is served twice by vLLM's CPU build at tensor-parallel
size 1, both engines selecting the ckpt backend, in this process:

* ``bf16_send``: an engine quantizing online (``quantization="fp8_per_channel"`` over the BF16
  checkpoint), refitted with BF16 weights; vLLM quantizes each layer as it reloads it;
* ``fp8_send``: an engine served from a compressed-tensors FP8 checkpoint
  (``ckpt_vllm.model.model_quantization.save_fp8_checkpoint``), refitted by a trainer engine with
  ``quantize_for_rollout``: it sends FP8 bytes and per-channel scales.

This process is the trainer: two versions of the weights, A and B (bf16), alternate so every
refit changes the model. Each repetition times one refit of each (each first in turn, after
1.5 s with both engines idle: vLLM's processes spin for a second after each call), then checks
that both engines generate the same greedy tokens (vLLM's quantization and the sender's are
the same arithmetic); with ``--check ends``, only after the warm-up and the last repetition
(one of each version: FP8 generation on a CPU without AMX takes about a minute per engine at
48 layers). Reported: bytes on the wire (the sender's payload), refit times, and the
sender's quantizing on its own (``quantize_weights`` over the version, timed alone). Writes
``fp8_refit.json`` and ``.md`` into ``--out`` (``fp8_refit_<N>_layers`` with another
``--layers``); exits 1 unless the goals hold: bytes at most 0.52x and time at most 0.7x of the
BF16 send.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from http_vs_offline import VERSIONS, OfflineClient, make_versions, offline_tokens, timed  # noqa: E402
from refit_vs_reload import MODEL, make_model  # noqa: E402
from scaffold import in_scratch, set_up_process, write_results  # noqa: E402

MIB = 1 << 20
BYTES_GOAL, TIME_GOAL = 0.52, 0.7


def run(reps: int, bucket_size: int, layers: int, out: Path, check_every: bool = True) -> dict[str, Any]:
    set_up_process()  # both engines' workers on core 1
    results = in_scratch(
        "ckpt_vllm_fp8_bench_", lambda workdir: _run_in(workdir, reps, bucket_size, layers, check_every)
    )
    # Another model size is another result: it does not overwrite the default one's.
    name = "fp8_refit" if layers == MODEL["num_hidden_layers"] else f"fp8_refit_{layers}_layers"
    write_results(out, name, results, report_table(results))
    return results


def _run_in(workdir: Path, reps: int, bucket_size: int, layers: int, check_every: bool) -> dict[str, Any]:
    from safetensors import safe_open
    from vllm import LLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from ckpt_core.refit.quantize import QuantizationSpec, quantize_weights
    from ckpt_core.refit.quantize.fp8 import Fp8Format
    from ckpt_vllm.model.model_quantization import save_fp8_checkpoint
    from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo

    make_model(workdir / "start", layers)
    versions = make_versions(workdir / "start", workdir)
    save_fp8_checkpoint(workdir / "start", workdir / "start_fp8")
    common = {"enforce_eager": True, "max_model_len": 128, "dtype": "bfloat16", "seed": 0, "skip_tokenizer_init": True}
    transfer = {"weight_transfer_config": {"backend": "ckpt"}}
    llms = {
        "bf16_send": LLM(model=str(workdir / "start"), quantization="fp8_per_channel", **transfer, **common),
        "fp8_send": LLM(model=str(workdir / "start_fp8"), **transfer, **common),
    }
    try:
        engines = {
            method: WeightTransferTrainerFactory.trainer_init(
                CkptTrainerInitInfo(
                    rank=0,
                    transport="gloo_cpu",
                    bucket_size_bytes=bucket_size,
                    engine_kwargs={"quantize_for_rollout": method == "fp8_send"},
                ),
                client=OfflineClient(llm),
            )
            for method, llm in llms.items()
        }
        # What the workers publish: the weights the FP8 checkpoint holds with a scale.
        with safe_open(str(workdir / "start_fp8" / "model.safetensors"), framework="pt") as fp8:
            scaled = {name.removesuffix("_scale") for name in fp8.keys() if name.endswith(".weight_scale")}  # noqa: SIM118
        spec = QuantizationSpec(dtype=torch.bfloat16, fmt=Fp8Format.PER_CHANNEL, weights=frozenset(scaled))
        rows: list[dict[str, Any]] = []
        try:
            for rep in range(-1, reps):  # rep -1: the warm-up, untimed
                version = VERSIONS[rep % 2]
                row: dict[str, Any] = {"version": version}
                for method in list(llms)[rep % 2 :] + list(llms)[: rep % 2]:
                    engine = engines[method]
                    row[f"{method}_s"] = timed(
                        functools.partial(engine.send_weights, versions[version], weight_version=version)
                    )
                    row[f"{method}_bytes"] = getattr(engine.engine, "last_stats").payload_bytes  # noqa: B009
                started = time.perf_counter()
                for _ in quantize_weights(iter(versions[version]), spec, destination="benchmark"):
                    pass
                row["quantize_s"] = time.perf_counter() - started
                checked = check_every or rep in (-1, reps - 1)
                if checked and len({str(offline_tokens(llm)) for llm in llms.values()}) != 1:
                    raise AssertionError(f"rep {rep}: after {version} the two FP8 engines generate other tokens")
                if rep >= 0:
                    rows.append(row)
                    print(f"rep {rep}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_s")))
        finally:
            for engine in engines.values():
                engine.shutdown()
            for llm in llms.values():
                llm.shutdown_weight_transfer_engine()
    finally:
        for llm in llms.values():
            llm.llm_engine.engine_core.shutdown()
    median = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "version"}
    ratios = {
        "bytes": median["fp8_send_bytes"] / median["bf16_send_bytes"],
        "time": median["fp8_send_s"] / median["bf16_send_s"],
    }
    return {
        "model_bytes": sum(t.nbytes for _, t in versions["A"]),
        "quantized_weights": len(spec.weights),
        "bucket_size": bucket_size,
        "backend": "gloo_cpu",
        "token_checks": "every repetition" if check_every else "after the warm-up and the last repetition",
        "goals": {"bytes": BYTES_GOAL, "time": TIME_GOAL},
        "reps": rows,
        "median": median,
        "ratios": ratios,
        "goals_met": {"bytes": ratios["bytes"] <= BYTES_GOAL, "time": ratios["time"] <= TIME_GOAL},
    }


def report_table(r: dict[str, Any]) -> str:
    m, q = r["median"], r["ratios"]
    return (
        f"Refit into an FP8 vLLM (CPU build, TP 1, gloo_cpu): {r['model_bytes'] / 1e6:.0f} MB of bf16 weights, "
        f"{r['quantized_weights']} of them per-channel FP8 in the engine; {r['bucket_size'] // MIB} MiB buckets; "
        f"medians of {len(r['reps'])} repetitions.\n\n"
        "| | bytes on the wire | refit |\n| --- | --- | --- |\n"
        f"| BF16 sent, vLLM quantizes on load | {m['bf16_send_bytes'] / 1e6:.1f} MB | {m['bf16_send_s']:.3f} s |\n"
        f"| FP8 sent (quantize on send) | {m['fp8_send_bytes'] / 1e6:.1f} MB | {m['fp8_send_s']:.3f} s |\n"
        f"| ratio (goal) | {q['bytes']:.3f}x ({BYTES_GOAL}) | {q['time']:.2f}x ({TIME_GOAL}) |\n\n"
        f"The sender's quantizing alone (one version, one thread): {m['quantize_s']:.3f} s.\n"
    )


def main(argv: list[str] | None = None) -> int:
    from ckpt_core.cli import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--bucket-size", type=parse_size, default=32 * MIB)
    parser.add_argument("--layers", type=int, default=MODEL["num_hidden_layers"], help="decoder layers (22 MB each)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--check", choices=["every", "ends"], default="every", help="when tokens are compared")
    args = parser.parse_args(argv)
    results = run(args.reps, args.bucket_size, args.layers, args.out, check_every=args.check == "every")
    print(report_table(results))
    return 0 if all(results["goals_met"].values()) else 1


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    sys.exit(main())
