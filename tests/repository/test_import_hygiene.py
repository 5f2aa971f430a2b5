"""Importing ``ckpt_core`` or listing backend names imports no backend, no heavy optional
dependency and no CUDA; resolving one backend imports only that one. Checked in a fresh
interpreter, since this test process has long since imported everything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.distributions import run_python

PLUGINS = ("ckpt_gloo_cpu", "ckpt_nccl", "ckpt_cuda_ipc")
HEAVY = ("nemo_automodel", "ray", "cupy", "transformers", "safetensors", "pynvml")

PROBE = """
    import json, sys

    WATCHED = WATCHED_MODULES

    def loaded():
        return sorted({m.split(".")[0] for m in sys.modules} & set(WATCHED))

    import ckpt_core
    after_import = loaded()
    names = ckpt_core.backend_names()
    after_names = loaded()
    import ckpt_core.base, ckpt_core.chunking, ckpt_core.contract, ckpt_core.errors, ckpt_core.hooks
    import ckpt_core.registry, ckpt_core.transport.engine, ckpt_core._internal.bucket_io
    import ckpt_core.transport.torch_distributed, ckpt_core._internal.checksum, ckpt_core.tensors
    import ckpt_core._internal.receive, ckpt_core._internal.send, ckpt_core._internal.wire
    after_core_modules = loaded()
    ckpt_core.hooks.plugin_manager()
    after_hooks = loaded()
    import torch
    cuda_initialized = torch.cuda.is_initialized()
    engine = ckpt_core.create_checkpoint_engine("gloo_cpu", bucket_size_bytes=1024, engine_kwargs={})
    after_resolve = loaded()
    print(json.dumps({
        "names": names,
        "after_import": after_import,
        "after_names": after_names,
        "after_core_modules": after_core_modules,
        "after_hooks": after_hooks,
        "cuda_initialized": cuda_initialized,
        "after_resolve": after_resolve,
    }))
""".replace("WATCHED_MODULES", repr((*PLUGINS, *HEAVY)))


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder: Path = tmp_path_factory.mktemp("hygiene")
    return run_python(PROBE, cwd=folder, env={"CKPT_CORE_DISABLE_PLUGIN_AUTOLOAD": "0"})


def test_import_and_names_import_no_backend(probe: dict[str, Any]) -> None:
    assert {"gloo_cpu", "nccl", "cuda_ipc"} <= set(probe["names"])
    assert probe["after_import"] == []
    assert probe["after_names"] == []


def test_core_modules_import_no_backend_and_no_heavy_dependency(probe: dict[str, Any]) -> None:
    assert probe["after_core_modules"] == []
    assert probe["after_hooks"] == []
    assert probe["cuda_initialized"] is False


def test_resolving_one_backend_imports_only_that_one(probe: dict[str, Any]) -> None:
    assert probe["after_resolve"] == ["ckpt_gloo_cpu"]
