"""An RL-style loop against ``vllm serve``: the trainer refits the server over HTTP with vLLM's
own weight-transfer API, choosing a ckpt-engine transport by name.

    python examples/vllm_serve_rl_loop.py [--transport gloo_cpu|cuda_ipc] [--steps 3] [--tp 1]
                                          [--url http://127.0.0.1:8000]

This script is the trainer: it starts ``vllm serve`` (the CPU build works) as a subprocess on
loopback with ``--weight-transfer-config '{"backend": "ckpt"}'`` and ``VLLM_SERVER_DEV_MODE=1``
(which mounts vLLM's RL routes), or refits the one already serving at ``--url`` (a model of
the same shapes, started so), trains a tiny random Qwen2 with real AdamW steps, and after each
step pauses the server, sends its weights (cast to bf16) through vLLM's
``WeightTransferTrainerFactory`` and ``HTTPVLLMWeightSyncClient``, and resumes it. Generation
goes through the OpenAI-compatible ``/v1/completions`` route. At the end vLLM itself loads the
trainer's final weights from disk: a fresh server, or with ``--url`` the same server through
vLLM's own in-place reload (``/collective_rpc`` ``reload_weights``, a dev-mode route). The
script exits 1 unless that generates the tokens the refitted server did and ``/weight_info``
reported each step's version. About two minutes on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import requests
import torch

PROMPT = list(range(1, 20))
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0


def vllm_serve(model: str, tp: int, log_path: str) -> contextlib.AbstractContextManager[str]:
    """``vllm serve model`` on a free loopback port, the ckpt backend selected; its URL once
    ``/health`` answers (ckpt-vllm's launcher: :mod:`ckpt_vllm.devtools.serve`)."""
    from ckpt_vllm.devtools.serve import local_vllm_serve

    env = {  # vLLM's CPU build reads these two
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", "nobind" if tp == 1 else "|".join(map(str, range(tp)))
        ),
    }
    args = [
        "--served-model-name", "tiny", "--dtype", "bfloat16", "--enforce-eager", "--skip-tokenizer-init",
        "--max-model-len", "128", "--seed", "0",
    ]  # fmt: skip
    return local_vllm_serve(model, log_path=log_path, tp=tp, args=args, env=env, start_timeout_s=START_TIMEOUT_S)


def post(url: str, route: str, **body: Any) -> Any:
    response = requests.post(f"{url}/{route}", json=body or None, timeout=CALL_TIMEOUT_S)
    response.raise_for_status()
    return response.json()


def complete(url: str) -> list[int]:
    """Greedy tokens of ``PROMPT`` through the OpenAI-compatible completions route."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    answer = post(url, "v1/completions", **body)
    return list(answer["choices"][0]["token_ids"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="gloo_cpu", help="any installed ckpt-core backend (ckpt-engine list)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--url", help="refit this running server instead of starting one")
    args = parser.parse_args(argv)
    # A SIGTERM ends the script through its finally blocks, so the servers it started stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import transformers
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

    # Importing it registers the "ckpt" backend with vLLM's trainer factory.
    from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo

    workdir = tempfile.mkdtemp(prefix="vllm_serve_rl_loop_")
    start, final = os.path.join(workdir, "start"), os.path.join(workdir, "final")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64: vLLM's CPU attention refuses 16
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    transformers.Qwen2ForCausalLM(config).bfloat16().save_pretrained(start)
    model = transformers.Qwen2ForCausalLM.from_pretrained(start, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def bf16_weights() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model.state_dict().items():  # cast as the refit asks for each one
            yield name, tensor.detach().to(torch.bfloat16)

    engine_kwargs = {"device": "cpu"} if args.transport == "cuda_ipc" else {}
    serving = contextlib.nullcontext(args.url) if args.url else vllm_serve(start, args.tp, f"{workdir}/serve.log")
    with serving as url:
        info = CkptTrainerInitInfo(
            rank=0,
            transport=args.transport,
            bucket_size_bytes=1 << 20,
            rollout_world_size=args.tp,
            engine_kwargs=engine_kwargs,
        )
        engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(url))
        versions_ok = True
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, config.vocab_size, (4, 32))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            before = complete(url)
            post(url, "pause")  # vLLM's RL flow: no request sees half a refit; caches cleared
            started = time.perf_counter()
            engine.send_weights(bf16_weights(), weight_version=f"step-{step}")
            seconds = time.perf_counter() - started
            post(url, "resume")
            version = requests.get(f"{url}/weight_info", timeout=CALL_TIMEOUT_S).json()["weight_version"]
            versions_ok &= version == f"step-{step}"
            after = complete(url)
            print(f"step {step}: loss {float(loss):.3f}, refit in {seconds * 1e3:.0f} ms, server at {version}")
            print(f"  before: {before}\n  after:  {after}")
        engine.shutdown()
        model.save_pretrained(final, state_dict=dict(bf16_weights()))

    if args.url:  # another server of the same shapes would be a second copy of a model that may not fit
        reload = {"weights_path": final, "is_checkpoint_format": True}
        post(args.url, "collective_rpc", method="reload_weights", kwargs=reload)
        post(args.url, "reset_prefix_cache")  # it holds keys and values of the refitted weights
        expected, loaded_by = complete(args.url), "the same server reloading them with vLLM's own loader"
    else:
        with vllm_serve(final, args.tp, os.path.join(workdir, "fresh.log")) as url:
            expected, loaded_by = complete(url), "a fresh server loading them"
    if after != expected:
        print(f"MISMATCH: the refitted server generates {after}, {loaded_by} {expected}")
        return 1
    if not versions_ok:
        print("MISMATCH: /weight_info did not report the version each refit gave")
        return 1
    print(f"OK: after {args.steps} refits over HTTP the server generates what {loaded_by} from disk does")
    return 0


if __name__ == "__main__":
    sys.exit(main())
