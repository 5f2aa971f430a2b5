"""``CheckpointingConfig``: the per-save options of :class:`AutomodelCheckpointManager`.

The seed API types ``checkpointing_cfg`` as NeMo RL's ``CheckpointingConfig``; this
project does not depend on NeMo RL, so it defines the keys one save uses, and takes NeMo RL's
whole mapping: the keys of NeMo RL's checkpoint manager (``enabled``, ``checkpoint_dir``,
``save_period``, ``keep_top_k``, ...: when, where and how many) are accepted and ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["MODEL_SAVE_FORMATS", "NEMO_RL_MANAGER_KEYS", "CheckpointingConfig", "ModelSaveFormat"]

ModelSaveFormat = Literal["safetensors", "torch_save"]

#: The on-disk model formats, by the names nemo_automodel uses for them.
MODEL_SAVE_FORMATS: tuple[ModelSaveFormat, ...] = ("safetensors", "torch_save")

#: Keys of NeMo RL's ``CheckpointingConfig`` that its checkpoint manager reads (when and where
#: to save, which checkpoints to keep), not one save: ``from_mapping`` accepts and ignores them.
NEMO_RL_MANAGER_KEYS = frozenset(
    {
        "enabled",
        "checkpoint_dir",
        "metric_name",
        "higher_is_better",
        "save_period",
        "keep_top_k",
        "ft_keep_latest_k",
        "ft_save_period",
        "checkpoint_must_save_by",
        "pretrained_checkpoint",
        "save_optimizer",
    }
)


@dataclass(frozen=True)
class CheckpointingConfig:
    """How :meth:`AutomodelCheckpointManager.save_checkpoint` writes one checkpoint.

    Attributes:
        model_save_format: ``"safetensors"`` (Hugging Face sharded safetensors, written
            through DCP) or ``"torch_save"`` (plain DCP ``.distcp`` shards). PEFT adapters
            are always written as safetensors, whatever this says.
        save_consolidated: Also write a consolidated Hugging Face copy (config, index,
            ``model-0000N-of-0000M.safetensors``) under ``<weights>/model/consolidated/``.
            Only meaningful for full-model safetensors saves.
        is_peft: Save only the LoRA/PEFT adapter. ``save_checkpoint(lora_enabled=True)``
            turns this on too.
        model_cache_dir: Hugging Face cache directory where the base model lives (used
            to copy its config/metadata into consolidated output). ``None``: the HF hub cache.
        model_repo_id: Hugging Face repo id of the base model, if any.
        peft_config: The nemo_automodel ``PeftConfig`` of an adapter save, used when
            ``save_checkpoint`` is given none (NeMo RL carries it in this config too).
        dequantize_base_checkpoint: nemo_automodel's option of the same name (``None``: its
            own choice), passed through.
        is_async: Must be ``False``: saves are synchronous here (asynchronous DCP saves need a
            wait before the next save that this manager does not make), so ``True`` is refused
            rather than ignored.

    Raises:
        ValueError: On an unknown ``model_save_format``.
        TypeError: On a field of the wrong type.
    """

    model_save_format: ModelSaveFormat = "safetensors"
    save_consolidated: bool = False
    is_peft: bool = False
    model_cache_dir: str | None = None
    model_repo_id: str | None = None
    peft_config: Any = None
    dequantize_base_checkpoint: bool | None = None
    is_async: bool = False

    def __post_init__(self) -> None:
        if self.model_save_format not in MODEL_SAVE_FORMATS:
            raise ValueError(
                f"CheckpointingConfig.model_save_format must be one of {list(MODEL_SAVE_FORMATS)}, "
                f"got {self.model_save_format!r}."
            )
        for name in ("save_consolidated", "is_peft", "is_async"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CheckpointingConfig.{name} must be a bool, got {type(getattr(self, name)).__name__}.")
        if self.model_cache_dir is not None and not isinstance(self.model_cache_dir, (str, os.PathLike)):
            raise TypeError(
                "CheckpointingConfig.model_cache_dir must be a path or None, "
                f"got {type(self.model_cache_dir).__name__}."
            )
        if self.model_repo_id is not None and not isinstance(self.model_repo_id, str):
            raise TypeError(
                f"CheckpointingConfig.model_repo_id must be a str or None, got {type(self.model_repo_id).__name__}."
            )
        if self.dequantize_base_checkpoint is not None and not isinstance(self.dequantize_base_checkpoint, bool):
            raise TypeError(
                "CheckpointingConfig.dequantize_base_checkpoint must be a bool or None, "
                f"got {type(self.dequantize_base_checkpoint).__name__}."
            )
        if self.is_async:
            raise ValueError(
                "CheckpointingConfig.is_async=True is not supported: AutomodelCheckpointManager saves "
                "synchronously. Set is_async to False."
            )

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> CheckpointingConfig:
        """Build a config from a mapping: the dataclass fields, plus NeMo RL's manager keys
        (:data:`NEMO_RL_MANAGER_KEYS`), which are ignored. NeMo RL's spellings of "unset" mean
        the default: ``model_save_format: None``, and ``""`` for ``model_cache_dir`` and
        ``model_repo_id``.

        Raises:
            ValueError: If the mapping has any other key (typos are not ignored).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(mapping) - known - NEMO_RL_MANAGER_KEYS)
        if unknown:
            raise ValueError(
                f"Unknown CheckpointingConfig keys {unknown}; the known keys are {sorted(known)}, and "
                f"NeMo RL's checkpoint-manager keys {sorted(NEMO_RL_MANAGER_KEYS)} are accepted and ignored."
            )
        used = {key: value for key, value in mapping.items() if key in known}
        if used.get("model_save_format", "") is None:
            del used["model_save_format"]
        for key in ("model_cache_dir", "model_repo_id"):
            if used.get(key) == "":
                used[key] = None
        return cls(**used)

    @classmethod
    def coerce(cls, value: object) -> CheckpointingConfig:
        """Return ``value`` as a config: a config passes through, a mapping is converted.

        Raises:
            TypeError: If ``value`` is ``None`` or neither a config nor a mapping.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_mapping(value)
        if value is None:
            raise TypeError(
                "checkpointing_cfg is required: pass checkpointing_cfg=CheckpointingConfig(...) "
                "(from ckpt_core.automodel) or a mapping with the same keys."
            )
        raise TypeError(
            f"checkpointing_cfg must be a ckpt_core.automodel.CheckpointingConfig or a mapping with its keys, "
            f"got {type(value).__module__}.{type(value).__qualname__}."
        )

    def checkpointer_updates(self, *, is_peft: bool) -> dict[str, Any]:
        """The nemo_automodel ``CheckpointingConfig`` fields this config sets for one save."""
        updates: dict[str, Any] = {
            "model_save_format": self.model_save_format,
            "save_consolidated": self.save_consolidated,
            "is_peft": is_peft,
            "model_repo_id": self.model_repo_id,
        }
        if self.dequantize_base_checkpoint is not None:
            updates["dequantize_base_checkpoint"] = self.dequantize_base_checkpoint
        if self.model_cache_dir is not None:
            updates["model_cache_dir"] = os.fspath(self.model_cache_dir)
        return updates
