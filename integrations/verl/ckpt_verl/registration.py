"""Importing this module registers every installed ckpt-core backend in verl's registry.

``import verl`` imports it through the ``verl.plugins`` entry point (unless
``VERL_USE_EXTERNAL_PLUGINS=none``); where plugins are off, name it in verl's config as
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=ckpt_verl.registration``,
which verl imports in every worker before it looks a backend up. Each backend registers as
``ckpt_<name>`` (``ckpt_gloo_cpu``, ``ckpt_cuda_ipc``, ``ckpt_nccl``): a
:class:`~ckpt_verl.engine.CkptVerlEngine` subclass bound to that name. Listing backends reads
entry points only: no backend, and no CUDA library, is imported until a class is built.
"""

from __future__ import annotations

from verl.checkpoint_engine.base import CheckpointEngineRegistry

from ckpt_core.registry import backend_names
from ckpt_verl.engine import CkptVerlEngine, verl_backend_name

__all__ = ["REGISTERED", "register_all"]


def register_all() -> dict[str, type[CkptVerlEngine]]:
    """Register (again) a class per installed ckpt-core backend; returns them by verl name."""
    registered = {}
    for backend in backend_names():
        name = verl_backend_name(backend)
        engine_class = type(f"CkptVerlEngine_{backend}", (CkptVerlEngine,), {"backend": backend})
        CheckpointEngineRegistry.register(name)(engine_class)
        registered[name] = engine_class
    return registered


REGISTERED = register_all()
"""verl backend name -> the class registered under it, at import."""
