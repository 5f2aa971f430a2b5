"""A fourth refit kind costs one module: this file alone defines a stage, runs it on real
transports, and checks that it keeps every contract the built-in kinds keep.

The stage XORs every byte of every weight with a key on the way out and undoes it on the way
in. Added to an engine class's ``refit_stages``, its option (``xor_key``) joins that class's
schema, is agreed between workers, and wraps each destination stream after the built-in
stages (so beside layouts it XORs the parts each destination keeps). The refits run between
real processes over gloo_cpu and cuda_ipc (on the host), one stream for two rollout ranks and
a stream of its own for each (with layouts), and arrive bit for bit.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ckpt_core.errors import EngineOptionError
from ckpt_core.options import Option, OptionValues
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.refit import Batches, RefitStage, Stream, Weights
from ckpt_core.refit.layout import WeightLayout, slices, whole
from ckpt_core.registry import resolve_backend
from ckpt_core.stats import RefitStats
from ckpt_core.testing.in_process import InProcessEngine
from ckpt_core.transport import BucketedEngine

BUCKET = 1 << 14
TIMEOUT_S = 30.0
ROWS = 6  # of each 2-D weight: rollout rank 0 keeps the first half, rank 1 the rest


def _checked_key(option: Option, owner: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
        raise EngineOptionError(f"{owner}: {option.name} must be an int in [0, 255], got {value!r}")
    return value


def xored(tensor: torch.Tensor, key: int) -> torch.Tensor:
    """``tensor``'s bytes XORed with ``key``, in a new tensor of its shape and dtype."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return (flat ^ key).view(tensor.dtype).reshape(tensor.shape)


class XorStage(RefitStage):
    """Every byte of every weight XORed with ``xor_key`` on the way out, and back on the way in."""

    options: ClassVar[tuple[Option, ...]] = (
        Option.custom(
            "xor_key",
            0,
            "every byte sent is XORed with this key, and back on receipt (0: off)",
            parse=_checked_key,
            kind="int in [0, 255]",
            agreed=True,
        ),
    )

    def __init__(self, key: int) -> None:
        self.key = key
        self.sent: dict[tuple[int, ...], int] = {}  # weights XORed per stream, last refit
        self.undone = 0  # weights un-XORed, last refit

    @classmethod
    def from_options(cls, values: OptionValues, *, owner: str) -> XorStage | None:
        return cls(values.xor_key) if values.xor_key else None

    def send_stream(self, stream: Stream, weights: Weights, stats: RefitStats) -> Weights:
        self.sent[stream.ranks] = 0
        for name, tensor in weights:
            self.sent[stream.ranks] += 1
            yield name, xored(tensor, self.key)

    def receive(self, batches: Batches, stats: RefitStats) -> Batches:
        self.undone = 0
        try:
            for batch in batches:
                self.undone += len(batch)
                yield [(name, xored(tensor, self.key)) for name, tensor in batch]
        finally:
            batches.close()


def with_xor(engine_class: type[BucketedEngine]) -> type[BucketedEngine]:
    """``engine_class`` running the XOR stage after its own stages: how a kind is registered."""
    return type(
        f"Xor{engine_class.__name__}", (engine_class,), {"refit_stages": (*engine_class.refit_stages, XorStage)}
    )


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """Weights of several dtypes and shapes (0-d and empty too), different for each version."""
    generator = torch.Generator().manual_seed(version)
    return [
        ("a.weight", torch.randn(ROWS, 33, generator=generator).to(torch.bfloat16)),
        ("b.weight", torch.randint(-128, 127, (ROWS, 700), generator=generator, dtype=torch.int8)),
        ("c.bias", torch.rand(17, generator=generator) > 0.5),
        ("d.scale", torch.tensor(float(version) + 0.5, dtype=torch.float64)),
        ("e.empty", torch.empty(0, 4)),
        ("f.weight", torch.randn(ROWS, 2048, generator=generator)),  # spans buckets
    ]


def layout(rank: int) -> WeightLayout:
    """Rank ``rank`` of 2 keeps its half of the rows of each 2-D weight, the rest whole."""
    kept = {}
    for name, tensor in weights(0):
        shape = tuple(tensor.shape)
        if len(shape) == 2 and shape[0] == ROWS:
            kept[name] = slices(shape, 0, [(0, ROWS // 2)] if rank == 0 else [(ROWS // 2, ROWS - ROWS // 2)])
        else:
            kept[name] = whole(shape)
    return WeightLayout(kept)


def expected(version: int, rank: int, sharded: bool) -> dict[str, torch.Tensor]:
    half = slice(0, ROWS // 2) if rank == 0 else slice(ROWS // 2, ROWS)
    return {
        name: tensor[half] if sharded and tensor.dim() == 2 and tensor.shape[0] == ROWS else tensor
        for name, tensor in weights(version)
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if (a.shape, a.dtype) != (b.shape, b.dtype):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class StageSide:
    """One worker process: an engine of ``backend`` with the XOR stage, driven by the test."""

    def __init__(self, *, role: str, rank: int, backend: str, engine_kwargs: dict[str, Any]) -> None:
        engine_class = resolve_backend(backend)
        assert issubclass(engine_class, BucketedEngine)
        self.role, self.rank = role, rank
        self.engine = with_xor(engine_class)(bucket_size=BUCKET, **engine_kwargs)

    def prepare(self, *, layout: dict[str, Any] | None = None) -> dict[str, Any]:
        metadata = self.engine.prepare()
        if layout is not None:
            metadata["weight_layout"] = layout
        return metadata

    def init(self, *, metadata: list[Any], num_rollout: int) -> None:
        if self.role == "policy":
            self.engine.init_policy_process_group(
                worker_rank=self.rank, train_world_size=1, rollout_world_size=num_rollout, metadata=metadata
            )
        else:
            self.engine.init_rollout_process_group(
                rollout_rank=self.rank, train_world_size=1, rollout_world_size=num_rollout, metadata=metadata
            )

    def refit(self, *, version: int, sharded: bool) -> dict[str, Any]:
        """This side of one refit. The policy reports how many weights its stage XORed per
        stream; a rollout checks every weight bit for bit and reports the wrong ones."""
        stage = next(stage for stage in self.engine._stages if isinstance(stage, XorStage))
        if self.role == "policy":
            asyncio.run(self.engine.send_weights(weight for weight in weights(version)))
            return {"sent": {str(list(ranks)): count for ranks, count in stage.sent.items()}}

        async def receive() -> dict[str, torch.Tensor]:
            return {name: t.clone() async for batch in self.engine.receive_weight_batches() for name, t in batch}

        received = asyncio.run(receive())
        wanted = expected(version, self.rank, sharded)
        wrong = sorted(name for name in wanted if name not in received or not same_bits(received[name], wanted[name]))
        return {"wrong": wrong, "names": sorted(received), "undone": stage.undone}

    def finalize(self) -> None:
        self.engine.finalize()


def _call(pool: LocalProcessPool, method: str, per_worker: list[dict[str, Any]]) -> list[Any]:
    results = pool.call([(i, method, kwargs) for i, kwargs in enumerate(per_worker)], TIMEOUT_S + 30)
    failed = [result.describe() for result in results if not result.ok]
    assert not failed, "\n".join(failed)
    return [result.value for result in results]


BACKENDS = {"gloo_cpu": {}, "cuda_ipc_cpu": {"device": "cpu"}}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("sharded", [False, True], ids=["one-stream", "fanout-with-layouts"])
def test_a_stage_defined_here_runs_on_real_transports_bit_for_bit(
    backend: str, sharded: bool, import_root: Path, short_tmp: Path
) -> None:
    name = "cuda_ipc" if backend.startswith("cuda_ipc") else backend
    topology = "fanout" if sharded else "broadcast"
    kwargs: dict[str, Any] = {**BACKENDS[backend], "timeout_s": TIMEOUT_S, "topology": topology, "xor_key": 0x5A}
    kwargs["shard_expert_weights"] = sharded
    if name == "cuda_ipc":
        kwargs["socket_dir"] = str(short_tmp)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(import_root), env.get("PYTHONPATH")]))
    service = f"{__name__}:StageSide"
    roles = [("policy", 0), ("rollout", 0), ("rollout", 1)]
    specs = [{"service": service, "role": r, "rank": k, "backend": name, "engine_kwargs": kwargs} for r, k in roles]
    with LocalProcessPool(specs, labels=[f"{r}{k}" for r, k in roles], env=env) as pool:
        layouts = [None, *(layout(rank).to_json() if sharded else None for rank in range(2))]
        metadata = _call(pool, "prepare", [{"layout": entry} for entry in layouts])
        _call(pool, "init", [{"metadata": metadata, "num_rollout": 2}] * 3)
        for version in range(3):  # the later refits replay the first one's packing
            policy, *rollouts = _call(pool, "refit", [{"version": version, "sharded": sharded}] * 3)
            streams = ["[0]", "[1]"] if sharded else ["[0, 1]"]
            assert policy["sent"] == dict.fromkeys(streams, len(weights(version))), policy
            for rank, rollout in enumerate(rollouts):
                assert rollout["wrong"] == [], f"rollout {rank}, version {version}: {rollout['wrong']} arrived wrong"
                assert rollout["names"] == sorted(expected(version, rank, sharded)), rollout
                assert rollout["undone"] == len(weights(version)), "the stage did not unwrap every weight"
        _call(pool, "finalize", [{}] * 3)


# --- in one process: the option's life ----------------------------------------------------


def test_the_stage_option_joins_the_schema_of_the_class_that_runs_it_only() -> None:
    engine_class = with_xor(InProcessEngine)
    assert "xor_key" in engine_class.options and engine_class.options["xor_key"].agreed
    assert "xor_key" not in InProcessEngine.options
    assert "xor_key" in (engine_class.__doc__ or ""), "the generated option list names it"
    with pytest.raises(EngineOptionError, match="xor_key must be an int in \\[0, 255\\]"):
        engine_class(bucket_size=BUCKET, xor_key=256)
    with pytest.raises(EngineOptionError, match="xor_key"):
        InProcessEngine(bucket_size=BUCKET, xor_key=1)


def test_workers_whose_keys_differ_are_refused_at_init_naming_the_option() -> None:
    engine_class = with_xor(InProcessEngine)
    policy = engine_class(bucket_size=BUCKET, xor_key=1)
    rollout = engine_class(bucket_size=BUCKET, xor_key=2)
    metadata = [policy.prepare(), rollout.prepare()]
    with pytest.raises(EngineOptionError, match="xor_key"):
        policy.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)


def test_two_stages_declaring_one_option_are_refused_when_the_class_is_defined() -> None:
    class Twin(XorStage):
        pass

    with pytest.raises(TypeError, match="both declare the option 'xor_key'"):
        type("Twice", (InProcessEngine,), {"refit_stages": (*InProcessEngine.refit_stages, XorStage, Twin)})
