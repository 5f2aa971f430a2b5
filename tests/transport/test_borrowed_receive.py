"""``borrow_received_tensors``: whole tensors handed out as views of the transport's buffer,
valid until the next batch is asked for; everything else as before."""

from __future__ import annotations

import pytest
import torch

from ckpt_core.errors import EngineOptionError
from ckpt_core.testing.in_process import InProcessEngine, connected_pair, run_refit

BUCKET = 64 << 10


def weights() -> list[tuple[str, torch.Tensor]]:
    """Whole tensors of several buckets, one tensor split over buckets, odd dtypes and sizes."""
    generator = torch.Generator().manual_seed(7)
    out = [(f"layer{i}.weight", torch.randn(64, 100 + i, generator=generator)) for i in range(6)]
    out.append(("split.weight", torch.randn(3 * BUCKET // 4, generator=generator)))  # spans buckets
    out.append(("mask", torch.rand(33, generator=generator) > 0.5))
    out.append(("half", torch.randn(7, 9, generator=generator).to(torch.bfloat16)))
    out.append(("empty", torch.empty(0, 4)))
    return out


def views_of_a_bucket(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == BUCKET and tensor.numel() * tensor.element_size() < BUCKET


@pytest.mark.parametrize("direct_chunks", [False, True], ids=["packed", "direct-chunks-transport"])
def test_borrowed_batches_copied_on_arrival_are_bit_exact_and_whole_tensors_are_views(direct_chunks: bool) -> None:
    """Over a transport that takes direct chunks too: a borrowing rollout says so in its
    metadata and its sender packs every chunk, so the large layer tensors (above the direct
    threshold of a quarter bucket) are borrowed as well."""
    policy, rollout = connected_pair(BUCKET, borrow_received_tensors=True, direct_chunks=direct_chunks)
    source = weights()
    copies: list[tuple[str, torch.Tensor]] = []
    borrowed: list[str] = []
    outcome = run_refit(policy, rollout, lambda: iter(source))
    # run_refit keeps the batches: their borrowed tensors are stale now; prove it below, and
    # take copies on arrival in the next refit.
    assert outcome.send_error is None and outcome.receive_error is None

    import asyncio
    import threading

    sender = threading.Thread(target=lambda: asyncio.run(policy.send_weights(iter(source))))  # type: ignore[arg-type]
    sender.start()

    async def receive() -> None:
        async for batch in rollout.receive_weight_batches():
            for name, tensor in batch:
                if views_of_a_bucket(tensor):
                    borrowed.append(name)
                copies.append((name, tensor.clone()))

    asyncio.run(receive())
    sender.join(30)
    assert [n for n, _ in copies] == [n for n, _ in source]
    for (name, got), (_, want) in zip(copies, source):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
    assert "layer0.weight" in borrowed and "split.weight" not in borrowed  # split tensors are assembled
    assert policy.sender is not None and policy.sender.direct_posts == 0
    assert policy.last_stats is not None and policy.last_stats.direct_chunks == 0
    policy.finalize()
    rollout.finalize()


def test_a_borrowed_tensor_kept_past_the_next_batch_shows_later_bytes() -> None:
    """What the docs call undefined, shown: the slot was refilled by a later bucket."""
    policy, rollout = connected_pair(BUCKET, borrow_received_tensors=True)
    source = weights()
    outcome = run_refit(policy, rollout, lambda: iter(source))
    assert outcome.receive_error is None
    first_name, first = outcome.batches[0][0]
    assert first_name == "layer0.weight" and views_of_a_bucket(first)
    assert not torch.equal(first, source[0][1])
    policy.finalize()
    rollout.finalize()


def test_by_default_received_tensors_own_their_memory_and_stay_valid() -> None:
    policy, rollout = connected_pair(BUCKET)
    source = weights()
    outcome = run_refit(policy, rollout, lambda: iter(source))
    assert outcome.receive_error is None
    for (name, got), (_, want) in zip(outcome.received, source):
        assert torch.equal(got, want) and not views_of_a_bucket(got), name
    policy.finalize()
    rollout.finalize()


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_the_option_takes_a_bool(bad: object) -> None:
    with pytest.raises(EngineOptionError, match="borrow_received_tensors"):
        InProcessEngine(bucket_size=BUCKET, borrow_received_tensors=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("backend", "options"), [("gloo_cpu", {}), ("cuda_ipc", {"device": "cpu"})], ids=["gloo_cpu", "cuda_ipc_cpu"]
)
def test_borrowed_refits_between_processes_are_bit_exact(backend: str, options: dict[str, object]) -> None:
    """1 policy -> 2 rollout processes, two refits, every tensor's digest taken on arrival
    (``RefitWorker`` does that for a borrowing engine) checked against the sender's."""
    from ckpt_core.orchestration.coordinator import RefitCoordinator
    from ckpt_core.orchestration.local import LocalProcessPool
    from ckpt_core.orchestration.worker import refit_worker_specs

    specs, labels = refit_worker_specs(
        backend=backend,
        num_policy=1,
        num_rollout=2,
        bucket_size=1 << 20,
        engine_kwargs={**options, "borrow_received_tensors": True},
        weights="ckpt_core.bench.synthetic:transformer_weights",
        weights_params={"size_bytes": 6 << 20, "seed": 5},
    )
    with LocalProcessPool(specs, labels=labels) as pool:
        coordinator = RefitCoordinator(pool, num_policy=1, num_rollout=2, timeout_s=60)
        coordinator.setup()
        try:
            for _ in range(2):
                report = coordinator.refit()  # raises unless every digest matches, in order
                assert all(r["tensors"] == report.policy[0]["tensors"] for r in report.rollout)
                # Borrowing rollouts ask their sender to pack everything: a direct chunk (gloo's
                # way for chunks of a quarter bucket and more) would land in fresh memory.
                assert [r["stats"]["direct_chunks"] for r in report.rollout] == [0, 0]
                assert report.policy[0]["stats"]["direct_chunks"] == 0
        finally:
            coordinator.finalize()
