"""The options schema (``ckpt_core.options``) and ``Topology``: declared once per engine class,
inherited and extended by subclasses, read by the registry, the engine's constructor, the
settings check at init, the Ray config and ``ckpt-engine list``."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any, ClassVar

import pytest
import torch

from ckpt_core import create_checkpoint_engine
from ckpt_core.cli import main
from ckpt_core.errors import EngineOptionError, InvalidArgumentError
from ckpt_core.options import REQUIRED, Option, OptionSchema, check_bucket_size, schema_of
from ckpt_core.orchestration.coordinator import RefitCoordinator
from ckpt_core.testing.in_process import InProcessEngine
from ckpt_core.topology import Topology
from ckpt_core.transport import BucketedEngine, DistributedEngine
from ckpt_gloo_cpu.engine import GlooCpuCheckpointEngine
from ckpt_nccl.engine import NcclCheckpointEngine


class Flavoured(InProcessEngine):
    """An engine with an option of its own, one that every worker must share."""

    backend_name: ClassVar[str] = "memory"
    options = InProcessEngine.options.extend(
        Option.choice("flavour", "plain", ("plain", "spicy"), "how it tastes", agreed=True)
    )


# --- the schema itself ---------------------------------------------------------------------


def test_subclasses_inherit_extend_and_narrow_the_schema() -> None:
    base = BucketedEngine.options.names()
    assert base == [  # the engine's own, then each refit stage's, in refit_stages order
        "timeout_s",
        "checksum",
        "release_after_refit",
        "borrow_received_tensors",
        "quantize_for_rollout",
        "shard_expert_weights",
        "delta",
        "delta_max_baseline_bytes",
        "delta_check",
    ]
    assert DistributedEngine.options.names() == [*base, "topology", "host", "auth_token"]
    assert GlooCpuCheckpointEngine.options.names() == [*base, "topology", "host", "auth_token", "device"]
    assert NcclCheckpointEngine.options["topology"].choices == ("broadcast", "paired")
    assert DistributedEngine.options["topology"].choices == ("broadcast", "paired", "fanout")  # unchanged
    assert InProcessEngine.options["timeout_s"].default == 20.0 and BucketedEngine.options["timeout_s"].default == 300.0
    assert schema_of(Flavoured) is Flavoured.options and "flavour" in Flavoured.options


def test_one_checksum_default_for_every_engine() -> None:
    from ckpt_core.registry import resolve_backend

    for backend in ("gloo_cpu", "nccl", "cuda_ipc"):
        assert resolve_backend(backend).options["checksum"].default is False  # type: ignore[attr-defined]
    assert InProcessEngine(bucket_size=64).checksum is False


def test_a_name_is_declared_once_and_replaced_only_if_there() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        BucketedEngine.options.extend(Option.flag("checksum", True, "again"))
    with pytest.raises(KeyError, match="no option 'checksumm'"):
        BucketedEngine.options.replace("checksumm", default=True)


def test_a_class_whose_options_are_not_a_schema_is_refused() -> None:
    with pytest.raises(TypeError, match="options must be an OptionSchema"):

        class Wrong(InProcessEngine):
            options = {"flavour": "plain"}  # type: ignore[assignment]


def test_parse_gives_defaults_and_checked_values() -> None:
    values = GlooCpuCheckpointEngine.options.parse("G", {"bucket_size": 64, "topology": "paired", "timeout_s": 5})
    assert values.topology is Topology.PAIRED and values.timeout_s == 5.0 and values.checksum is False
    assert values["host"] == "127.0.0.1" and dict(values)["device"] == "cpu"
    with pytest.raises(AttributeError, match="no option 'hots'"):
        values.hots  # noqa: B018


def test_an_unknown_option_names_the_closest_and_the_accepted() -> None:
    with pytest.raises(EngineOptionError, match=r"Flavoured has no option 'flavor' \(did you mean 'flavour'\?\)"):
        Flavoured(bucket_size=64, flavor="spicy")  # NeMo RL's construction: EngineClass(bucket_size=..., **kw)
    assert Flavoured.options.closest("chcksum") == "checksum" and Flavoured.options.closest("zzz") is None


def test_a_missing_required_option_is_named() -> None:
    schema = OptionSchema(Option.text("token", REQUIRED, "a secret"))
    with pytest.raises(EngineOptionError, match="E requires option\\(s\\) token"):
        schema.parse("E", {})


BAD_VALUES = [
    ("timeout_s", 0, "timeout_s must be a finite number > 0"),
    ("timeout_s", float("nan"), "timeout_s must be a finite number > 0"),
    ("timeout_s", 10**9, "timeout_s must be at most"),
    ("checksum", 1, "checksum must be True or False"),
    ("release_after_refit", "yes", "release_after_refit must be True or False"),
    ("shard_expert_weights", None, "shard_expert_weights must be True or False"),
    ("borrow_received_tensors", 0, "borrow_received_tensors must be True or False"),
    ("topology", "ring", "topology must be one of 'broadcast', 'paired', 'fanout', got 'ring'"),
    ("topology", 3, "topology must be one of"),
    ("host", "", "host must be a non-empty address string"),
    ("auth_token", 5, "auth_token must be a non-empty string or None"),
    ("device", "cuda", "device must be 'cpu'"),
]


@pytest.mark.parametrize(("option", "value", "message"), BAD_VALUES, ids=[f"{o}={v!r}" for o, v, _ in BAD_VALUES])
def test_each_bad_value_is_an_engine_option_error(option: str, value: Any, message: str) -> None:
    with pytest.raises(EngineOptionError, match=message):
        GlooCpuCheckpointEngine(bucket_size=64, **{option: value})
    with pytest.raises(EngineOptionError, match=message):
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=64, engine_kwargs={option: value})


def _no_weights() -> Generator[tuple[str, torch.Tensor], None, None]:
    yield from ()


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "64MiB", None])
def test_a_bad_bucket_size_is_one_error_type_everywhere(size: Any) -> None:
    """From the registry, the engine, the chunker and a Ray config: ``EngineOptionError``, which
    ``except InvalidArgumentError`` / ``ValueError`` / ``TypeError`` all still catch."""
    from ckpt_core.chunking import split_weight_chunks
    from ckpt_core.orchestration.ray import RayRefitConfig

    attempts = [
        lambda: create_checkpoint_engine("gloo_cpu", bucket_size_bytes=size, engine_kwargs={}),
        lambda: GlooCpuCheckpointEngine(bucket_size=size),
        lambda: split_weight_chunks(_no_weights(), size),
        lambda: RayRefitConfig.from_mapping({"backend": "gloo_cpu", "bucket_size_bytes": size}),
    ]
    for attempt in attempts:
        with pytest.raises(EngineOptionError, match="bucket_size(_bytes)? must be a positive int") as info:
            attempt()
        assert isinstance(info.value, InvalidArgumentError | ValueError | TypeError)
    assert check_bucket_size(4096) == 4096


def test_options_are_checked_before_availability() -> None:
    """nccl's values are checked by its schema on any machine, before CUDA is looked for."""
    with pytest.raises(EngineOptionError, match="topology must be one of 'broadcast', 'paired', got 'fanout'"):
        NcclCheckpointEngine(bucket_size=64, topology="fanout")


# --- the settings check at init reads the schema -------------------------------------------


def test_agreed_settings_are_the_schemas_agreed_options() -> None:
    engine = Flavoured(bucket_size=64, flavour="spicy", timeout_s=3)
    assert engine._agreed_settings() == {
        "bucket_size": 64,
        "checksum": False,
        "shard_expert_weights": False,
        "quantize_for_rollout": False,
        "delta": False,
        "flavour": "spicy",
    }
    gloo = GlooCpuCheckpointEngine(bucket_size=64, topology="fanout")
    assert gloo._agreed_settings()["topology"] == "fanout"
    assert type(gloo._agreed_settings()["topology"]) is str  # plain JSON in prepare() metadata


@pytest.mark.parametrize(
    ("policy", "rollout", "named"),
    [
        ({"flavour": "spicy"}, {}, "flavour 'plain', this worker 'spicy'"),
        ({"checksum": True}, {}, "checksum False, this worker True"),
        ({}, {"bucket_size": 128}, "bucket_size 128, this worker 64"),
    ],
)
def test_a_disagreeing_option_is_refused_at_init(policy: dict[str, Any], rollout: dict[str, Any], named: str) -> None:
    sender = Flavoured(**{"bucket_size": 64, **policy})
    receiver = Flavoured(**{"bucket_size": 64, **rollout})
    try:
        metadata = [sender.prepare(), receiver.prepare()]
        with pytest.raises(EngineOptionError, match=named) as info:
            sender.init_policy_process_group(worker_rank=0, train_world_size=1, rollout_world_size=1, metadata=metadata)
        assert "bucket_size_bytes" in str(info.value)  # how the user spells it, from the schema
    finally:
        sender.finalize()
        receiver.finalize()


# --- Topology ------------------------------------------------------------------------------


def test_topology_parses_config_strings_and_names_the_choices() -> None:
    assert Topology.parse("paired") is Topology.PAIRED and Topology.parse(Topology.FANOUT) is Topology.FANOUT
    assert Topology.PAIRED == "paired" and json.dumps(Topology.FANOUT) == '"fanout"'
    with pytest.raises(EngineOptionError, match="E: topology must be one of 'broadcast', 'fanout', got 'paired'"):
        Topology.parse("paired", owner="E", choices=("broadcast", "fanout"))


@pytest.mark.parametrize(
    ("topology", "feeds", "sources"),
    [
        # policy rank -> rollout ranks it feeds (3 policy, 2 rollout ranks); rollout rank -> its source
        (Topology.BROADCAST, {0: [0, 1], 1: [], 2: []}, {0: 0, 1: 0}),
        (Topology.FANOUT, {0: [0, 1], 1: [], 2: []}, {0: 0, 1: 0}),
        (Topology.PAIRED, {0: [0], 1: [1], 2: []}, {0: 0, 1: 1}),
    ],
)
def test_who_sends_to_whom(topology: Topology, feeds: dict[int, list[int]], sources: dict[int, int]) -> None:
    for rank, destinations in feeds.items():
        assert topology.destinations(rank, 3, 2) == destinations
        assert topology.drains(rank, 3, 2) is (not destinations)
    for rank, source in sources.items():
        assert topology.source(rank) == source
        assert rank in topology.destinations(source, 3, 2)
    assert topology.separate_streams is (topology is Topology.FANOUT)
    assert topology.shares_link is (topology is Topology.BROADCAST)


def test_paired_needs_a_policy_rank_per_rollout_rank() -> None:
    Topology.PAIRED.check_world_sizes("E", 2, 2)
    Topology.BROADCAST.check_world_sizes("E", 1, 4)
    with pytest.raises(EngineOptionError, match="got 1 policy and 2 rollout ranks"):
        Topology.PAIRED.check_world_sizes("E", 1, 2)


def test_the_coordinator_and_the_engines_use_the_topology() -> None:
    assert RefitCoordinator(pool=[0, 1, 2], num_policy=2, num_rollout=1, topology="paired").topology is Topology.PAIRED  # type: ignore[arg-type]
    with pytest.raises(EngineOptionError, match="topology must be one of"):
        RefitCoordinator(pool=[0, 1], num_policy=1, num_rollout=1, topology="ring")  # type: ignore[arg-type]
    engine = GlooCpuCheckpointEngine(bucket_size=64, topology="paired")
    assert engine._destinations(1, 2, 2) == [1] and not engine._separate_streams()
    assert GlooCpuCheckpointEngine(bucket_size=64, topology="fanout")._separate_streams()
    assert InProcessEngine(bucket_size=64)._destinations(0, 1, 1) == [0]  # no topology option: broadcast


# --- ckpt-engine list ----------------------------------------------------------------------


def test_list_prints_each_backends_options_with_defaults_and_docs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    gloo = out.split("gloo_cpu options")[1].split("options (engine_kwargs")[0]
    rows = {line.split()[0]: line for line in gloo.splitlines() if line.startswith("  ") and line.split()}
    for name, option in GlooCpuCheckpointEngine.options.items():
        assert name in rows, f"{name} missing from:\n{gloo}"
        assert option.default_text() in rows[name] and option.doc[:30] in rows[name]
    assert "topology *" in rows["topology"]  # agreed options are marked
    nccl = out.split("nccl options")[1]
    assert "'broadcast' | 'paired'" in nccl and "'cuda' | 'cuda:N'" in nccl
    assert main(["list", "--no-options"]) == 0
    assert "options (engine_kwargs" not in capsys.readouterr().out


def test_list_json_carries_the_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "--json"]) == 0
    (gloo,) = [b for b in json.loads(capsys.readouterr().out) if b["name"] == "gloo_cpu"]
    assert gloo["options"] == GlooCpuCheckpointEngine.options.describe()


def test_bench_refuses_a_bad_option_before_starting_workers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--option", "checksum=yes", "--no-baseline"]) == 2
    assert "checksum must be True or False, got 'yes'" in capsys.readouterr().err
    assert main(["bench", "--option", "toplogy=paired", "--no-baseline"]) == 2
    assert "did you mean 'topology'" in capsys.readouterr().err
