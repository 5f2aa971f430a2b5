"""Backend registry: entry-point discovery, broken and duplicate plugins, ``module:ClassName``,
engine option checks, and ``list_backends``.

Discovery of distributions that are not part of this repo runs against real ones: they are
built and pip-installed into a temp dir, and a subprocess with that dir on ``PYTHONPATH``
does the lookups (one subprocess for all of them, since each pays for importing torch).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ckpt_core import backend_names, create_checkpoint_engine, list_backends, resolve_backend
from ckpt_core.errors import (
    BackendImportError,
    BackendUnavailableError,
    EngineOptionError,
    NotAnEngineError,
    UnknownBackendError,
)
from ckpt_core.transport import BucketedEngine
from tests.helpers.distributions import Distribution, install, run_python

# --- third-party distributions, in a subprocess ----------------------------------------------

EXTERNAL = """
    from typing import ClassVar

    from ckpt_core.base import CheckpointEngine
    from ckpt_core.transport import REQUIRED, Option
    from ckpt_core.transport.capabilities import BackendCapabilities
    from ckpt_core.transport.engine import BucketedEngine


    class ExternalEngine(BucketedEngine):
        backend_name: ClassVar[str] = "external_mem"
        capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
            devices=("cpu",), topologies=("broadcast",), placements=("colocated",)
        )

        @classmethod
        def unavailable_reason(cls):
            return "external_mem needs a flux capacitor"

        options = BucketedEngine.options.extend(Option.text("flavour", REQUIRED, "how it tastes"))

        def __init__(self, **options):
            super().__init__(**options)
            self.flavour = self.option_values.flavour

        def _connect_policy(self, worker_rank, train_world_size, rollout_world_size, metadata):
            raise NotImplementedError("a registry test: never connected")

        def _connect_rollout(self, rollout_rank, train_world_size, rollout_world_size, metadata):
            raise NotImplementedError("a registry test: never connected")


    class SeedOnlyEngine(CheckpointEngine):
        '''Written against the seed alone: no capabilities, no probe.'''

        def __init__(self, bucket_size):
            self.bucket_size = bucket_size

        def prepare(self):
            return {}

        def init_policy_process_group(self, *, worker_rank, train_world_size, rollout_world_size, metadata):
            pass

        def init_rollout_process_group(self, *, rollout_rank, train_world_size, rollout_world_size, metadata):
            pass

        async def send_weights(self, weights):
            for _ in weights:
                pass

        async def receive_weight_batches(self):
            return
            yield


    def helper_function():
        return 1
"""

BROKEN = """
    raise ImportError("ckpt_test_broken_engine needs libfoo_for_tests, which is not installed")
"""

DUPLICATE = """
    from ckpt_core.transport.engine import BucketedEngine


    class DupEngine(BucketedEngine):
        backend_name = "dup_mem"

        def _connect_policy(self, worker_rank, train_world_size, rollout_world_size, metadata):
            raise NotImplementedError("a registry test: never connected")

        def _connect_rollout(self, rollout_rank, train_world_size, rollout_world_size, metadata):
            raise NotImplementedError("a registry test: never connected")
"""

BACKENDS = "ckpt_core.backends"
DISTRIBUTIONS = [
    Distribution(
        "ckpt-test-external",
        {"ckpt_test_external_engine": EXTERNAL},
        {
            BACKENDS: {
                "external_mem": "ckpt_test_external_engine:ExternalEngine",
                "external_seed": "ckpt_test_external_engine:SeedOnlyEngine",
                "not_engine": "ckpt_test_external_engine:helper_function",
            }
        },
        version="1.2.3",
    ),  # fmt: skip
    Distribution(
        "ckpt-test-broken",
        {"ckpt_test_broken_engine": BROKEN},
        {BACKENDS: {"broken_mem": "ckpt_test_broken_engine:Engine"}},
    ),
    *(
        Distribution(
            f"ckpt-test-dup-{x}",
            {f"ckpt_test_dup_{x}": DUPLICATE},
            {BACKENDS: {"dup_mem": f"ckpt_test_dup_{x}:DupEngine"}},
        )
        for x in "ab"
    ),
]

PROBE = """
    import json
    from ckpt_core import CheckpointEngine, backend_names, create_checkpoint_engine, list_backends

    def attempt(make):
        try:
            return {"ok": make()}
        except Exception as exc:
            cause = exc.__cause__
            return {"error": type(exc).__name__, "message": str(exc),
                    "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}

    def create(name, **kwargs):
        return create_checkpoint_engine(name, bucket_size_bytes=4096, engine_kwargs=kwargs)

    def external():
        engine = create("external_mem", flavour="spicy")
        return {"class": f"{type(engine).__module__}:{type(engine).__name__}",
                "is_engine": isinstance(engine, CheckpointEngine),
                "bucket_size": engine.bucket_size, "flavour": engine.flavour,
                "metadata_backend": engine.prepare()["backend"]}

    result = {
        "names": backend_names(),
        "external": attempt(external),
        "external_missing_option": attempt(lambda: create("external_mem")),
        "external_typo": attempt(lambda: create("external_mem", flavor="x")),
        "external_seed": attempt(lambda: type(create("external_seed")).__name__),
        "gloo": attempt(lambda: type(create("gloo_cpu")).__name__),
        "unknown": attempt(lambda: create("gloo_cpux")),
        "broken": attempt(lambda: create("broken_mem")),
        "duplicate": attempt(lambda: create("dup_mem")),
        "duplicate_by_target": attempt(lambda: type(create("ckpt_test_dup_b:DupEngine")).__module__),
        "not_engine": attempt(lambda: create("not_engine")),
        "list": [info.to_dict() for info in list_backends()],
        "details": [info.to_dict() for info in list_backends(details=True)],
    }
    print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Install the test distributions and run every lookup once, in a fresh interpreter."""
    folder = tmp_path_factory.mktemp("registry-dists")
    site = install(DISTRIBUTIONS, folder)
    return run_python(PROBE, path=[site], cwd=folder)


def _entry(infos: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [info for info in infos if info["name"] == name]


def test_names_include_third_party_backends(probe: dict[str, Any]) -> None:
    for name in ("external_mem", "external_seed", "broken_mem", "dup_mem", "gloo_cpu", "nccl", "cuda_ipc"):
        assert name in probe["names"]
    assert probe["names"] == sorted(probe["names"])


def test_third_party_engine_is_created_by_name(probe: dict[str, Any]) -> None:
    assert probe["external"] == {
        "ok": {
            "class": "ckpt_test_external_engine:ExternalEngine",
            "is_engine": True,
            "bucket_size": 4096,
            "flavour": "spicy",
            "metadata_backend": "external_mem",
        }
    }
    assert probe["external_seed"] == {"ok": "SeedOnlyEngine"}


def test_third_party_options_are_checked(probe: dict[str, Any]) -> None:
    missing = probe["external_missing_option"]
    assert missing["error"] == "EngineOptionError" and "flavour" in missing["message"]
    typo = probe["external_typo"]
    assert typo["error"] == "EngineOptionError"
    assert "'flavor'" in typo["message"] and "did you mean 'flavour'" in typo["message"]


def test_broken_plugin_leaves_others_selectable(probe: dict[str, Any]) -> None:
    assert probe["gloo"] == {"ok": "GlooCpuCheckpointEngine"}
    assert "ok" in probe["external"]


def test_unknown_backend_lists_installed_and_broken(probe: dict[str, Any]) -> None:
    unknown = probe["unknown"]
    assert unknown["error"] == "UnknownBackendError"
    message = unknown["message"]
    for fragment in (
        "'gloo_cpux'",
        "Did you mean 'gloo_cpu'?",
        "gloo_cpu (ckpt-gloo-cpu 0.1.0)",
        "external_mem (ckpt-test-external 1.2.3)",
        # the broken plugin: its name, distribution, the cause and how to repair it
        "broken_mem",
        "ckpt-test-broken",
        "ImportError: ckpt_test_broken_engine needs libfoo_for_tests",
        "pip install --force-reinstall ckpt-test-broken",
        # the duplicate and the non-engine are reported, not hidden
        "dup_mem",
        "not_engine",
        "module:ClassName",
    ):
        assert fragment in message, f"{fragment!r} missing from:\n{message}"
    installed, _, failing = message.partition("Registered but failing to load:")
    assert "broken_mem" not in installed and "broken_mem" in failing


def test_broken_plugin_selected_directly(probe: dict[str, Any]) -> None:
    broken = probe["broken"]
    assert broken["error"] == "BackendImportError"
    hint = "pip install --force-reinstall ckpt-test-broken"
    for fragment in ("'broken_mem'", "ckpt-test-broken", "libfoo_for_tests", hint):
        assert fragment in broken["message"], f"{fragment!r} missing from {broken['message']!r}"
    assert broken["cause"].startswith("ImportError: ckpt_test_broken_engine needs libfoo_for_tests")


def test_duplicate_names_are_refused_naming_both(probe: dict[str, Any]) -> None:
    duplicate = probe["duplicate"]
    assert duplicate["error"] == "DuplicateBackendError"
    for fragment in ("'dup_mem'", "ckpt-test-dup-a", "ckpt-test-dup-b", "ckpt_test_dup_a:DupEngine",
                     "ckpt_test_dup_b:DupEngine"):  # fmt: skip
        assert fragment in duplicate["message"]
    assert probe["duplicate_by_target"] == {"ok": "ckpt_test_dup_b"}


def test_entry_point_to_a_non_engine(probe: dict[str, Any]) -> None:
    assert probe["not_engine"]["error"] == "NotAnEngineError"
    assert "helper_function" in probe["not_engine"]["message"]


def test_list_backends_reports_every_registration(probe: dict[str, Any]) -> None:
    infos = probe["list"]
    (external,) = _entry(infos, "external_mem")
    assert external == {
        "name": "external_mem",
        "distribution": "ckpt-test-external",
        "version": "1.2.3",
        "target": "ckpt_test_external_engine:ExternalEngine",
        "loads": True,
        "error": None,
        "unavailable_reason": None,
        "capabilities": None,
        "options": None,
    }
    (broken,) = _entry(infos, "broken_mem")
    assert broken["loads"] is False and "libfoo_for_tests" in broken["error"]
    duplicates = _entry(infos, "dup_mem")
    assert sorted(d["distribution"] for d in duplicates) == ["ckpt-test-dup-a", "ckpt-test-dup-b"]
    assert all(d["loads"] is False and "more than one distribution" in d["error"] for d in duplicates)
    (not_engine,) = _entry(infos, "not_engine")
    assert not_engine["loads"] is False


def test_list_backends_details(probe: dict[str, Any]) -> None:
    details = probe["details"]
    (external,) = _entry(details, "external_mem")
    assert external["capabilities"] == {"devices": ["cpu"], "topologies": ["broadcast"], "placements": ["colocated"]}
    assert external["unavailable_reason"] == "external_mem needs a flux capacitor"
    # Its options, read from its schema: the inherited ones and its own required one.
    flavour = {option["name"]: option for option in external["options"]}["flavour"]
    assert flavour == {"name": "flavour", "default": "required", "accepts": "non-empty string", "agreed": False,
                       "doc": "how it tastes"}  # fmt: skip
    assert [o["name"] for o in external["options"]][:3] == ["bucket_size", "timeout_s", "checksum"]
    (seed,) = _entry(details, "external_seed")
    assert seed["loads"] is True and seed["capabilities"] is None and seed["unavailable_reason"] is None
    assert seed["options"] is None  # an engine of the seed alone declares no schema
    (broken,) = _entry(details, "broken_mem")
    assert broken["loads"] is False and broken["capabilities"] is None


# --- the shipped backends, in this process ---------------------------------------------------

SHIPPED = {
    "gloo_cpu": ("ckpt-gloo-cpu", "ckpt_gloo_cpu.engine:GlooCpuCheckpointEngine"),
    "nccl": ("ckpt-nccl", "ckpt_nccl.engine:NcclCheckpointEngine"),
    "cuda_ipc": ("ckpt-cuda-ipc", "ckpt_cuda_ipc.engine:CudaIpcCheckpointEngine"),
}


def test_list_backends_shipped() -> None:
    infos = {info.name: info for info in list_backends()}
    for name, (distribution, target) in SHIPPED.items():
        info = infos[name]
        assert (info.distribution, info.target, info.loads, info.error) == (distribution, target, True, None)
        assert info.version == "0.1.0"
        assert info.capabilities is None and info.unavailable_reason is None  # details=False


def test_list_backends_details_shipped() -> None:
    infos = {info.name: info for info in list_backends(details=True)}
    json.dumps([info.to_dict() for info in infos.values()])  # plain data, for `ckpt-engine list --json`
    gloo = infos["gloo_cpu"]
    assert gloo.capabilities is not None and gloo.capabilities.devices == ("cpu",)
    assert set(gloo.capabilities.topologies) == {"broadcast", "paired", "fanout"}
    assert gloo.unavailable_reason is None
    nccl = infos["nccl"]
    assert nccl.loads and nccl.capabilities is not None and nccl.capabilities.devices == ("cuda",)
    if torch.cuda.is_available():
        assert nccl.unavailable_reason is None
    else:
        assert nccl.unavailable_reason is not None and "CUDA" in nccl.unavailable_reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_nccl_without_a_gpu_is_unavailable() -> None:
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        create_checkpoint_engine("nccl", bucket_size_bytes=1 << 20, engine_kwargs={})


# --- "module:ClassName" ----------------------------------------------------------------------


def test_module_class_name_targets() -> None:
    engine = create_checkpoint_engine(
        "ckpt_gloo_cpu.engine:GlooCpuCheckpointEngine", bucket_size_bytes=512, engine_kwargs={"topology": "paired"}
    )
    assert isinstance(engine, BucketedEngine) and type(engine).__name__ == "GlooCpuCheckpointEngine"
    assert engine.bucket_size == 512
    engine = create_checkpoint_engine(
        "ckpt_core.testing.in_process:InProcessEngine", bucket_size_bytes=64, engine_kwargs={}
    )
    assert type(engine).__name__ == "InProcessEngine"


@pytest.mark.parametrize(
    "target",
    [
        "json:dumps",
        "collections:OrderedDict",
        "ckpt_core.base:TensorMeta",
        "ckpt_core.base:CheckpointEngine",  # abstract
        "ckpt_gloo_cpu.engine:NoSuchClass",
        "ckpt_gloo_cpu.engine:",
        ":GlooCpuCheckpointEngine",
    ],
)
def test_targets_that_are_not_engines(target: str) -> None:
    with pytest.raises(NotAnEngineError, match="CheckpointEngine|no attribute|module:ClassName|abstract"):
        resolve_backend(target)
    with pytest.raises(NotAnEngineError):
        create_checkpoint_engine(target, bucket_size_bytes=64, engine_kwargs={})


def test_abstract_target_names_what_is_missing() -> None:
    with pytest.raises(NotAnEngineError, match="abstract.*prepare"):
        resolve_backend("ckpt_core.base:CheckpointEngine")


def test_target_whose_module_is_missing() -> None:
    with pytest.raises(BackendImportError, match="ckpt_no_such_module_for_tests") as info:
        resolve_backend("ckpt_no_such_module_for_tests:Engine")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


@pytest.mark.parametrize("backend", ["", None, 3])
def test_backend_must_be_a_non_empty_string(backend: Any) -> None:
    with pytest.raises(UnknownBackendError):
        create_checkpoint_engine(backend, bucket_size_bytes=64, engine_kwargs={})


def test_unknown_shipped_typo_in_process() -> None:
    with pytest.raises(UnknownBackendError, match="Did you mean 'nccl'") as info:
        create_checkpoint_engine("ncll", bucket_size_bytes=64, engine_kwargs={})
    assert "gloo_cpu (ckpt-gloo-cpu" in str(info.value)


# --- engine options --------------------------------------------------------------------------


def test_unknown_option_names_the_closest_and_the_accepted() -> None:
    with pytest.raises(EngineOptionError) as info:
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1024, engine_kwargs={"toplogy": "paired"})
    message = str(info.value)
    assert "'toplogy'" in message and "did you mean 'topology'?" in message
    for option in ("topology", "host", "timeout_s", "checksum"):
        assert option in message.partition("Accepted options:")[2]
    assert "bucket_size" not in message.partition("Accepted options:")[2]


def test_unknown_option_without_a_close_match() -> None:
    with pytest.raises(EngineOptionError, match="'zzz'.*Accepted options: .*topology") as info:
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1024, engine_kwargs={"zzz": 1})
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("engine_kwargs", [{"bucket_size": 1024}, {"bucket_size": 1024, "topology": "paired"}])
def test_bucket_size_in_engine_kwargs_is_refused(engine_kwargs: dict[str, Any]) -> None:
    with pytest.raises(EngineOptionError, match="bucket_size_bytes"):
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1024, engine_kwargs=engine_kwargs)


@pytest.mark.parametrize("engine_kwargs", [None, [("topology", "paired")], "topology=paired", {1: "x"}])
def test_engine_kwargs_must_be_a_dict_of_names(engine_kwargs: Any) -> None:
    with pytest.raises(EngineOptionError):
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1024, engine_kwargs=engine_kwargs)


@pytest.mark.parametrize(
    "engine_kwargs",
    [{"topology": "ring"}, {"timeout_s": 0}, {"timeout_s": float("nan")}, {"checksum": 1}, {"host": ""}],
    ids=str,
)
def test_option_values_are_checked_by_the_engine(engine_kwargs: dict[str, Any]) -> None:
    with pytest.raises(EngineOptionError):
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1024, engine_kwargs=engine_kwargs)


@pytest.mark.parametrize("bucket_size_bytes", [0, -1, 1.5, True, False, "4096", None, 4096.0])
def test_bucket_size_bytes_must_be_a_positive_int(bucket_size_bytes: Any) -> None:
    with pytest.raises(ValueError, match="bucket_size_bytes"):
        create_checkpoint_engine("gloo_cpu", bucket_size_bytes=bucket_size_bytes, engine_kwargs={})


@pytest.mark.parametrize("bucket_size_bytes", [1, 4096, 3 << 30])
def test_engine_receives_bucket_size(bucket_size_bytes: int) -> None:
    engine = create_checkpoint_engine(
        "gloo_cpu", bucket_size_bytes=bucket_size_bytes, engine_kwargs={"checksum": False}
    )
    assert isinstance(engine, BucketedEngine)
    assert engine.bucket_size == bucket_size_bytes
    assert engine.checksum is False


def test_bucket_size_bytes_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        create_checkpoint_engine("gloo_cpu", 4096, {})  # type: ignore[misc]


def test_a_blocked_backend_is_neither_listed_nor_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CORE_BLOCK_PLUGINS", "cuda_ipc,nccl")
    assert "cuda_ipc" not in backend_names() and "gloo_cpu" in backend_names()
    assert all(info.name != "nccl" for info in list_backends())
    with pytest.raises(UnknownBackendError, match="'cuda_ipc': it is blocked by CKPT_CORE_BLOCK_PLUGINS"):
        resolve_backend("cuda_ipc")
    resolve_backend("gloo_cpu")


def test_bench_without_its_default_backend_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pip install ckpt-core`` alone, then ``ckpt-engine bench``: gloo_cpu is another
    distribution. The installed entry points are those of this venv minus gloo_cpu's."""
    from importlib import metadata

    from ckpt_core import cli

    real = metadata.entry_points

    def without_gloo(*, group: str) -> metadata.EntryPoints:
        return metadata.EntryPoints(ep for ep in real(group=group) if ep.name != "gloo_cpu")

    monkeypatch.setattr(metadata, "entry_points", without_gloo)
    assert cli.main(["bench", "--size", "1MiB"]) == 2
    err = capsys.readouterr().err
    assert "'gloo_cpu' (the default backend) cannot be used" in err
    assert "pip install ckpt-gloo-cpu" in err
