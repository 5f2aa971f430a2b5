"""verl's own registry and config path build ckpt-core engines.

What verl does with ``actor_rollout_ref.rollout.checkpoint_engine`` (its
``CheckpointEngineWorker.__init__`` and the actor worker's, verl 0.9.1): the OmegaConf node
becomes a ``CheckpointEngineConfig`` (``omega_conf_to_dataclass``), ``custom_backend_module`` is
imported (``import_external_libs``), and ``CheckpointEngineRegistry.new(backend,
bucket_size=update_weights_bucket_megabytes << 20, **engine_kwargs.get(backend, {}))`` builds the
engine (the actor side adds ``is_master``). The tests below run those calls of verl's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is not installed (the dev set-up pins verl==0.9.1)")
from omegaconf import OmegaConf
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig

from ckpt_core.errors import BackendUnavailableError, EngineOptionError
from ckpt_core.registry import backend_names
from ckpt_verl.engine import CkptVerlEngine


def engine_from_config(yaml: str, *, trainer: bool) -> Any:
    """The engine verl builds from this ``checkpoint_engine`` config, on a trainer or a rollout."""
    config = omega_conf_to_dataclass(OmegaConf.create(yaml), CheckpointEngineConfig)
    assert isinstance(config, CheckpointEngineConfig)
    import_external_libs(config.custom_backend_module or None)
    extra = {"is_master": True} if trainer else {}
    return CheckpointEngineRegistry.new(
        config.backend,
        bucket_size=config.update_weights_bucket_megabytes << 20,
        **extra,
        **config.engine_kwargs.get(config.backend, {}),
    )


def test_every_installed_backend_is_registered_under_its_ckpt_name() -> None:
    for backend in backend_names():
        engine_class = CheckpointEngineRegistry.get(f"ckpt_{backend}")
        assert issubclass(engine_class, CkptVerlEngine) and engine_class.backend == backend


@pytest.mark.parametrize("trainer", [True, False], ids=["trainer", "rollout"])
def test_a_config_naming_ckpt_gloo_cpu_builds_its_engine_with_its_options(trainer: bool) -> None:
    engine = engine_from_config(
        """
        backend: ckpt_gloo_cpu
        update_weights_bucket_megabytes: 4
        engine_kwargs:
          ckpt_gloo_cpu: {topology: paired, timeout_s: 12}
          nccl: {rebuild_group: true}
        """,
        trainer=trainer,
    )
    assert type(engine.engine).__name__ == "GlooCpuCheckpointEngine"
    assert engine.engine.bucket_size == 4 << 20
    assert engine.engine.option_values.topology == "paired" and engine.engine.timeout_s == 12.0
    assert engine.is_master is trainer


def test_a_misspelled_option_is_refused_naming_the_accepted_ones() -> None:
    with pytest.raises(EngineOptionError, match="no option 'toplogy' \\(did you mean 'topology'\\?\\).*Accepted"):
        engine_from_config("{backend: ckpt_gloo_cpu, engine_kwargs: {ckpt_gloo_cpu: {toplogy: paired}}}", trainer=True)


def test_a_backend_that_cannot_run_here_says_why() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: nccl can run")
    with pytest.raises(BackendUnavailableError, match="'ckpt_nccl': ckpt-core's 'nccl' cannot run here: no CUDA"):
        engine_from_config("{backend: ckpt_nccl}", trainer=True)


def test_with_plugins_off_custom_backend_module_registers_the_backends() -> None:
    """``VERL_USE_EXTERNAL_PLUGINS=none`` keeps ``import verl`` from loading the entry point;
    ``custom_backend_module: ckpt_verl.registration`` then registers the names."""
    script = (
        "import verl\n"
        "from verl.checkpoint_engine.base import CheckpointEngineRegistry as R\n"
        "from verl.utils.import_utils import import_external_libs\n"
        "before = 'ckpt_gloo_cpu' in R._registry\n"
        "import_external_libs('ckpt_verl.registration')\n"
        "print(before, 'ckpt_gloo_cpu' in R._registry)\n"
    )
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "True"], done.stdout
