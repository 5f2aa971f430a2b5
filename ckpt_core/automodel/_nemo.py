"""The one place that imports nemo_automodel, on first use, with an install hint."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["INSTALL_HINT", "nemo_checkpoint_modules"]

INSTALL_HINT = "pip install 'ckpt-core[automodel]'"

_CHECKPOINT_MODULES = (
    "nemo_automodel.components.checkpoint.config",
    "nemo_automodel.components.checkpoint.addons",
    "nemo_automodel.components.checkpoint._backports.filesystem",
)


def nemo_checkpoint_modules() -> tuple[ModuleType, ModuleType, ModuleType]:
    """Import and return nemo_automodel's checkpoint ``(config, addons, filesystem)`` modules.

    Raises:
        ImportError: nemo_automodel (or one of its dependencies) cannot be imported;
            the message carries the install command and the cause is chained.
    """
    try:
        config, addons, filesystem = (importlib.import_module(name) for name in _CHECKPOINT_MODULES)
    except ImportError as exc:
        raise ImportError(
            "AutomodelCheckpointManager needs the nemo_automodel package, which could not be imported "
            f"({exc}). Install it with: {INSTALL_HINT}"
        ) from exc
    return config, addons, filesystem
