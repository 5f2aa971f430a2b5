"""An RL-style loop on Ray: train a tiny causal LM on a policy actor, refit rollout actors after
every step, and check that the rollout side now computes exactly the policy's logits.

    python examples/ray_rl_loop.py [--steps 3] [--rollout 2] [--address RAY_ADDRESS]

Needs ``ckpt-core[ray]``, ``ckpt-gloo-cpu`` and ``transformers``. The model is a Llama built
from a config (hidden size 32, 2 layers, vocabulary 128): nothing is downloaded. Without
``--address`` a local Ray cluster is started. Exits with status 1 if any rollout actor's
logits differ from the policy's after a refit.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator

import ray
import torch

from ckpt_core.orchestration.ray import RayRefitCoordinator, RefitActorMixin

MODEL = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
CALL_TIMEOUT_S = 300.0


def build_model(seed: int) -> torch.nn.Module:
    """The tiny Llama, initialized from ``seed``; one thread, so every actor computes alike."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def logits_of(model: torch.nn.Module, tokens: list[list[int]]) -> list:
    """Logits for ``tokens`` as nested lists (float32 -> float -> float32 is exact)."""
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.tolist()


@ray.remote(num_cpus=0)
class PolicyActor(RefitActorMixin):
    """Trains the model; the refit engine sends what ``weights()`` yields."""

    def __init__(self, seed: int) -> None:
        self.model = build_model(seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(seed + 1)
        self.batch = torch.randint(0, MODEL["vocab_size"], (8, 16), generator=generator)

    def train_step(self) -> float:
        """One optimizer step of next-token prediction on a fixed batch; returns the loss."""
        self.model.train()
        loss = self.model(self.batch, labels=self.batch).loss
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.model.state_dict().items()

    def logits(self, tokens: list[list[int]]) -> list:
        return logits_of(self.model, tokens)


@ray.remote(num_cpus=0)
class RolloutActor(RefitActorMixin):
    """Generates with its own copy of the model; received batches go to ``load_weights``."""

    def __init__(self, seed: int) -> None:
        self.model = build_model(seed)
        self.params = self.model.state_dict()

    def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in batch:
                target = self.params.get(name)
                if target is None:
                    raise KeyError(f"received {name!r}, which this model does not have")
                if target.shape != tensor.shape or target.dtype != tensor.dtype:
                    raise ValueError(
                        f"{name}: received {tuple(tensor.shape)} {tensor.dtype}, the model holds "
                        f"{tuple(target.shape)} {target.dtype}"
                    )
                target.copy_(tensor)

    def logits(self, tokens: list[list[int]]) -> list:
        return logits_of(self.model, tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps, each followed by a refit")
    parser.add_argument("--rollout", type=int, default=2, help="rollout actors (default 2)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    args = parser.parse_args(argv)

    ray.init(address=args.address, include_dashboard=False)
    policy = [PolicyActor.remote(seed=0)]
    rollout = [RolloutActor.remote(seed=100 + rank) for rank in range(args.rollout)]
    coordinator = RayRefitCoordinator(
        policy,
        rollout,
        {"backend": "gloo_cpu", "bucket_size_bytes": 1 << 20, "engine_kwargs": {"timeout_s": 120.0}},
        timeout_s=CALL_TIMEOUT_S,
    )
    coordinator.setup()
    probe = torch.randint(0, MODEL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(7)).tolist()

    def all_logits() -> tuple[torch.Tensor, list[torch.Tensor]]:
        answers = ray.get([a.logits.remote(probe) for a in policy + rollout], timeout=CALL_TIMEOUT_S)
        tensors = [torch.tensor(answer, dtype=torch.float32) for answer in answers]
        return tensors[0], tensors[1:]

    failed = False
    try:
        expected, got = all_logits()
        if any(torch.equal(g, expected) for g in got):
            print("a rollout actor matched the policy before any refit: the check below would prove nothing")
            return 1
        print("before the first refit, rollout logits differ from the policy's (different initializations)")
        for step in range(1, args.steps + 1):
            loss = ray.get(policy[0].train_step.remote(), timeout=CALL_TIMEOUT_S)
            started = time.perf_counter()
            report = coordinator.refit()
            seconds = time.perf_counter() - started
            expected, got = all_logits()
            equal = [torch.equal(g, expected) for g in got]
            mismatched = [rank for rank, ok in enumerate(equal) if not ok]
            verdict = f"MISMATCH on rollout ranks {mismatched}" if mismatched else "rollout logits == policy logits"
            print(
                f"step {step}: loss {loss:.4f}, weight version {report.weight_version}, "
                f"{report.rollout[0]['tensors']} tensors to {len(rollout)} rollout actors in {seconds:.3f} s, {verdict}"
            )
            failed = failed or not all(equal)
    finally:
        coordinator.finalize()
        ray.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
