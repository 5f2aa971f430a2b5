"""``AutomodelCheckpointManager``: durable checkpoints of DTensor models via nemo_automodel.

A thin, validated wrapper around nemo_automodel's ``Checkpointer``: it owns one
``Checkpointer`` per manager, keeps its config in step with each save or load, checks
checkpoint keys before loading, and turns bad input into typed errors. nemo_automodel
is imported when a manager is constructed, never when this module is imported.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_core.automodel._nemo import nemo_checkpoint_modules
from ckpt_core.automodel.checkpoint_files import (
    ADAPTER_WEIGHTS_FILE,
    DCP_METADATA_FILE,
    OPTIMIZER_SUBDIR,
    _infer_checkpoint_root,
    detect_checkpoint_format,
    model_dir_for_load,
    model_dir_for_save,
    read_checkpoint_keys,
)
from ckpt_core.automodel.config import MODEL_SAVE_FORMATS, CheckpointingConfig
from ckpt_core.automodel.errors import (
    CheckpointerNotInitializedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
)
from ckpt_core.automodel.keys import (
    ADAPTER_KEY_MARKER,
    expected_checkpoint_keys,
    model_state_dict_keys,
    validate_checkpoint_keys,
)

if TYPE_CHECKING:
    from nemo_automodel.components._peft.lora import PeftConfig
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig as NemoCheckpointingConfig
    from torch.distributed.device_mesh import DeviceMesh
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase

__all__ = ["AutomodelCheckpointManager"]

logger = logging.getLogger(__name__)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _wait_for_rank0() -> None:
    """After a rank-0-only write: every rank returns once it is on disk. A barrier of the
    trainer's default group (DCP saves use it already), bounded by that group's timeout."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _is_meta(param: torch.Tensor) -> bool:
    return param.device.type == "meta"


def _model_device(model: nn.Module) -> torch.device:
    """Device of the model's first materialized parameter (the accelerator if all are meta)."""
    for param in model.parameters():
        if not _is_meta(param):
            return param.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _has_checkpoint_files(directory: Path) -> bool:
    """Whether ``directory`` already holds model or optimizer checkpoint files."""
    if not directory.is_dir():
        return False
    return (
        (directory / DCP_METADATA_FILE).exists()
        or (directory / ADAPTER_WEIGHTS_FILE).exists()
        or any(directory.glob("*.safetensors"))
    )


def _refuse_overwrite(directory: Path, what: str) -> None:
    if _has_checkpoint_files(directory):
        raise CheckpointExistsError(
            f"{directory} already holds a {what} checkpoint; saving again would mix two checkpoints in one "
            "directory. Save into a new directory, or delete the old one first."
        )


def _optimizer_root_for_load(optimizer_path: str | os.PathLike[str]) -> str:
    """The directory to hand to nemo_automodel (it reads ``<that>/optim``) for an optimizer path.

    Accepts the ``optimizer_path`` given to ``save_checkpoint`` or its ``optim`` subdirectory.
    """
    path = Path(os.path.normpath(os.fspath(optimizer_path)))
    if path.name == OPTIMIZER_SUBDIR and not (path / OPTIMIZER_SUBDIR).is_dir():
        path = path.parent
    optim_dir = path / OPTIMIZER_SUBDIR
    if not (optim_dir / DCP_METADATA_FILE).is_file():
        raise CheckpointNotFoundError(
            f"No optimizer checkpoint at {optim_dir} (expected {DCP_METADATA_FILE} and *.distcp files). "
            "Pass the optimizer_path that save_checkpoint was given."
        )
    return os.fspath(path)


class AutomodelCheckpointManager:
    """Manages checkpointing for DTensor-based models using nemo_automodel's ``Checkpointer``.

    One manager wraps one ``Checkpointer`` (created by :meth:`init_checkpointer`) and
    keeps its configuration in step with every save (from ``checkpointing_cfg``) and
    load (from the format detected on disk). Collective: in a multi-rank job every
    rank calls the same methods in the same order; files are written into a shared
    filesystem. The default process group belongs to the caller: the manager never
    creates or changes it.

    Attributes:
        checkpointer: The underlying nemo_automodel ``Checkpointer``; ``None`` until
            :meth:`init_checkpointer` (or :meth:`load_checkpoint`) creates it.
        checkpoint_config: The current nemo_automodel ``CheckpointingConfig`` (the
            ``Checkpointer``'s own ``config`` object); ``None`` until then.
        model_state_dict_keys: The model's state dict keys; loads are checked against
            them. ``None``: check against the keys of the model being loaded.
    """

    def __init__(
        self,
        dp_mesh: DeviceMesh,
        tp_mesh: DeviceMesh,
        model_state_dict_keys: list[str] | None = None,
        moe_mesh: DeviceMesh | None = None,
    ) -> None:
        """Initialize the AutomodelCheckpointManager.

        Args:
            dp_mesh: The data parallel device mesh (one dimension).
            tp_mesh: The tensor parallel device mesh (one dimension).
            model_state_dict_keys: Optional list of model state dict keys, as
                ``model.state_dict().keys()`` names them.
            moe_mesh: Optional MoE device mesh, passed to the ``Checkpointer``.

        Raises:
            ImportError: nemo_automodel is not installed; the message gives the
                install command.
        """
        nemo_checkpoint_modules()  # fail here, with the install hint, not halfway through a save
        self.dp_mesh = dp_mesh
        self.tp_mesh = tp_mesh
        self.moe_mesh = moe_mesh
        self.checkpointer: Checkpointer | None = None
        self.checkpoint_config: NemoCheckpointingConfig | None = None
        self.model_state_dict_keys: list[str] | None = None
        if model_state_dict_keys is not None:
            self.set_model_state_dict_keys(model_state_dict_keys)

    def _get_dp_rank(self) -> int:
        """Get the data parallel rank (this process's coordinate on ``dp_mesh``)."""
        return self.dp_mesh.get_local_rank()

    def _get_tp_rank(self) -> int:
        """Get the tensor parallel rank (this process's coordinate on ``tp_mesh``)."""
        return self.tp_mesh.get_local_rank()

    # ----------------------------------------------------------------- config

    def init_checkpointer(
        self,
        config_updates: dict[str, Any] | None = None,
        checkpoint_root: str | None = None,
    ) -> None:
        """Initialize the Automodel Checkpointer if not already created.

        Creates a ``Checkpointer`` from nemo_automodel's ``CheckpointingConfig``
        defaults overridden by ``config_updates``. If a checkpointer already exists
        this does nothing (use :meth:`update_checkpointer_config` to change it).

        Args:
            config_updates: Fields of nemo_automodel's ``CheckpointingConfig`` to set,
                e.g. ``{"model_save_format": "torch_save", "save_consolidated": False}``.
            checkpoint_root: Optional root directory for checkpoints (its ``checkpoint_dir``).

        Raises:
            ValueError: An unknown field name or an invalid value.
        """
        if self.checkpointer is not None:
            return
        config_module, _, _ = nemo_checkpoint_modules()
        kwargs = self._validated_updates(config_updates)
        if "model_save_format" in kwargs:
            kwargs["model_save_format"] = self._save_format(kwargs["model_save_format"]).value
        if "save_consolidated" in kwargs:
            kwargs["save_consolidated"] = self._consolidated_mode(kwargs["save_consolidated"])
        if checkpoint_root is not None:
            kwargs["checkpoint_dir"] = os.fspath(checkpoint_root)
        kwargs.setdefault("model_state_dict_keys", self.model_state_dict_keys)
        config = config_module.CheckpointingConfig(**kwargs)
        self.checkpointer = config.build(
            dp_rank=self._get_dp_rank(),
            tp_rank=self._get_tp_rank(),
            pp_rank=0,
            moe_mesh=self.moe_mesh,
        )
        self.checkpoint_config = self.checkpointer.config

    def update_checkpointer_config(
        self,
        config_updates: dict[str, Any] | None = None,
        checkpoint_root: str | None = None,
    ) -> None:
        """Update the configuration of an existing Checkpointer.

        Sets the given fields on the existing ``Checkpointer``'s config, converting a
        string ``model_save_format`` to nemo_automodel's ``SerializationFormat`` and a
        bool/string ``save_consolidated`` to its ``SaveConsolidatedMode``, then
        rebuilds the checkpointer's addons (they depend on format and PEFT status).
        As in nemo_automodel, PEFT with ``torch_save`` falls back to safetensors. If
        no checkpointer exists, this does nothing.

        Args:
            config_updates: Fields of nemo_automodel's ``CheckpointingConfig`` to update.
            checkpoint_root: Optional root directory for checkpoints.

        Raises:
            ValueError: An unknown field name or an invalid value.
        """
        if self.checkpointer is None:
            return
        updates = self._validated_updates(config_updates)
        config = self.checkpointer.config
        for name, value in updates.items():
            setattr(config, name, self._coerce_field(name, value))
        if checkpoint_root is not None:
            config.checkpoint_dir = os.fspath(checkpoint_root)
        self._apply_peft_format_rule(config)
        self.checkpoint_config = config
        self._rebuild_checkpointer_addons()

    def _rebuild_checkpointer_addons(self) -> None:
        """Rebuild the checkpointer's ``_addons`` list from its current config.

        ``Checkpointer.__init__`` chooses its addons from the config (the consolidated
        Hugging Face metadata addon for full-model safetensors, the PEFT addon for
        adapters); after a config change the list must be chosen again. Mirrors
        nemo_automodel 0.7's rule. Does nothing without a checkpointer.
        """
        if self.checkpointer is None:
            return
        _, addons, filesystem = nemo_checkpoint_modules()
        config = self.checkpointer.config
        rebuilt: list[Any] = []
        if config.model_save_format == filesystem.SerializationFormat.SAFETENSORS and not config.is_peft:
            rebuilt.append(addons.ConsolidatedHFAddon())
        if config.is_peft:
            rebuilt.append(addons.PeftAddon())
        self.checkpointer._addons = rebuilt

    def set_model_state_dict_keys(self, keys: list[str]) -> None:
        """Set the model state dict keys that loads are checked against.

        Args:
            keys: List of model state dict keys (``model.state_dict()`` names).

        Raises:
            TypeError: ``keys`` is not a sequence of strings.
        """
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise TypeError(f"model_state_dict_keys must be a list of str, got {type(keys).__name__}.")
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise TypeError(f"model_state_dict_keys must hold only str; got {bad[:5]!r}.")
        self.model_state_dict_keys = list(keys)
        if self.checkpointer is not None:
            self.checkpointer.config.model_state_dict_keys = self.model_state_dict_keys

    @staticmethod
    def _validated_updates(config_updates: Mapping[str, Any] | None) -> dict[str, Any]:
        if config_updates is None:
            return {}
        if not isinstance(config_updates, Mapping):
            raise TypeError(f"config_updates must be a dict, got {type(config_updates).__name__}.")
        config_module, _, _ = nemo_checkpoint_modules()
        known = {f.name for f in dataclasses.fields(config_module.CheckpointingConfig)}
        unknown = sorted(set(config_updates) - known)
        if unknown:
            raise ValueError(
                f"Unknown checkpointer config fields {unknown}; nemo_automodel's CheckpointingConfig has "
                f"{sorted(known)}."
            )
        return dict(config_updates)

    @staticmethod
    def _save_format(value: Any) -> Enum:
        _, _, filesystem = nemo_checkpoint_modules()
        if isinstance(value, filesystem.SerializationFormat):
            return value
        if isinstance(value, str) and value in MODEL_SAVE_FORMATS:
            return filesystem.SerializationFormat(value)
        raise ValueError(f"model_save_format must be one of {list(MODEL_SAVE_FORMATS)}, got {value!r}.")

    @staticmethod
    def _consolidated_mode(value: Any) -> Enum:
        config_module, _, _ = nemo_checkpoint_modules()
        mode = config_module.SaveConsolidatedMode
        if isinstance(value, mode):
            return value
        if isinstance(value, bool):
            return mode.EVERY if value else mode.FALSE
        aliases = {"true": mode.EVERY, "every": mode.EVERY, "final": mode.FINAL, "false": mode.FALSE}
        if isinstance(value, str) and value.strip().lower() in aliases:
            return aliases[value.strip().lower()]
        raise ValueError(f"save_consolidated must be a bool or one of {sorted(aliases)}, got {value!r}.")

    def _coerce_field(self, name: str, value: Any) -> Any:
        if name == "model_save_format":
            return self._save_format(value)
        if name == "save_consolidated":
            return self._consolidated_mode(value)
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        return value

    @staticmethod
    def _apply_peft_format_rule(config: NemoCheckpointingConfig) -> None:
        _, _, filesystem = nemo_checkpoint_modules()
        if config.is_peft and config.model_save_format == filesystem.SerializationFormat.TORCH_SAVE:
            logger.warning("PEFT adapters are always saved as safetensors; ignoring model_save_format='torch_save'.")
            config.model_save_format = filesystem.SerializationFormat.SAFETENSORS

    def _require_checkpointer(self, action: str) -> Checkpointer:
        if self.checkpointer is None:
            raise CheckpointerNotInitializedError(
                f"Cannot {action}: the checkpointer is not initialized. Call "
                "AutomodelCheckpointManager.init_checkpointer() first."
            )
        return self.checkpointer

    # ------------------------------------------------------------- base model

    def load_base_model(
        self,
        model: nn.Module,
        model_name: str,
        hf_cache_dir: str | None = None,
        dequantize_base_checkpoint: bool = False,
        peft_init_method: str | None = None,
    ) -> None:
        """Load base model weights using the Automodel Checkpointer.

        Initializes the model's weights (materializing meta-device parameters; LoRA
        adapters are initialized with ``peft_init_method`` when given), then loads the
        Hugging Face weights into the (possibly parallelized) model. A model with LoRA
        adapters gets only its base weights from the checkpoint (the checkpointer is
        switched to PEFT mode). When ``model_name`` is a local directory of safetensors
        whose names match the model one to one (no key conversion declared), their
        names are checked against the model's non-adapter keys first.

        Args:
            model: The model to load weights into.
            model_name: Hugging Face repo id (found in ``hf_cache_dir``) or a local directory.
            hf_cache_dir: Optional Hugging Face cache directory (default: the
                checkpointer's ``model_cache_dir``).
            dequantize_base_checkpoint: Whether to dequantize a quantized base checkpoint.
            peft_init_method: Initialization for PEFT adapters, e.g. ``"xavier"``.

        Raises:
            CheckpointerNotInitializedError: (an ``AssertionError``) before ``init_checkpointer``.
            CheckpointKeyMismatchError: A local checkpoint's names differ from the model's.
        """
        checkpointer = self._require_checkpointer("load the base model")
        has_adapters = any(ADAPTER_KEY_MARKER in name for name, _ in model.named_parameters())
        # With adapters present the base checkpoint must not be asked for adapter tensors.
        self.update_checkpointer_config(
            {"is_peft": has_adapters, "dequantize_base_checkpoint": dequantize_base_checkpoint}
        )
        if os.path.isdir(model_name):
            self._validate_base_keys(model, model_name)
        device = _model_device(model)
        checkpointer.initialize_model_weights(model, device, peft_init_method=peft_init_method)
        root_dir = os.fspath(hf_cache_dir) if hf_cache_dir is not None else checkpointer.config.model_cache_dir
        checkpointer.load_base_model(model, device, root_dir, model_name)

    def _validate_base_keys(self, model: nn.Module, model_dir: str) -> None:
        if getattr(model, "state_dict_adapter", None) is not None or getattr(
            model, "_checkpoint_conversion_mapping", None
        ):
            logger.debug("Base checkpoint keys of %s are converted on load; skipping the name check.", model_dir)
            return
        if not any(Path(model_dir).glob("*.safetensors")):
            return
        keys = self.model_state_dict_keys if self.model_state_dict_keys is not None else model_state_dict_keys(model)
        expected = {k for k in expected_checkpoint_keys(keys, is_peft=False) if ADAPTER_KEY_MARKER not in k}
        validate_checkpoint_keys(model_dir, read_checkpoint_keys(model_dir), expected, model=model)

    # ------------------------------------------------------------------- save

    def save_checkpoint(
        self,
        model: nn.Module,
        weights_path: str,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_path: str | None = None,
        scheduler: LRScheduler | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        tokenizer_path: str | None = None,
        checkpointing_cfg: CheckpointingConfig | None = None,
        lora_enabled: bool = False,
        peft_config: PeftConfig | None = None,
    ) -> None:
        """Save a checkpoint of the model.

        Model files go to ``weights_path/model/`` (or to ``weights_path`` itself when
        its last component is ``model``). The optimizer state, with the scheduler
        state, is saved to ``optimizer_path/optim/`` only if both ``optimizer`` and
        ``optimizer_path`` are given. The tokenizer is saved to ``tokenizer_path`` if
        given, else beside the weights (see docs/automodel.md for where), by rank 0 alone;
        in a distributed run every rank returns only once it is written.

        Args:
            model: The model to save.
            weights_path: Path to save model weights.
            optimizer: Optional optimizer to save.
            optimizer_path: Optional path to save optimizer state.
            scheduler: Optional learning rate scheduler (saved with the optimizer).
            tokenizer: Optional tokenizer to save with the checkpoint.
            tokenizer_path: Optional path to save tokenizer separately.
            checkpointing_cfg: Checkpointing configuration (required): a
                :class:`CheckpointingConfig`, or a mapping with its keys (NeMo RL's whole
                ``CheckpointingConfig`` mapping is accepted: its manager keys are ignored).
            lora_enabled: Whether LoRA is enabled; saves only the adapter.
            peft_config: The nemo_automodel ``PeftConfig`` of the adapter (required
                when saving an adapter; ``checkpointing_cfg.peft_config`` if not given).

        Raises:
            CheckpointerNotInitializedError: Before ``init_checkpointer``.
            TypeError: ``checkpointing_cfg`` missing or of the wrong type.
            ValueError: An adapter save without ``peft_config``, or ``peft_config``
                given for a full-model save.
            CheckpointExistsError: The target directory already holds a checkpoint.
        """
        checkpointer = self._require_checkpointer("save a checkpoint")
        cfg = CheckpointingConfig.coerce(checkpointing_cfg)
        if peft_config is None:
            peft_config = cfg.peft_config
        is_peft = self._peft_mode(cfg, lora_enabled, peft_config)
        model_dir = model_dir_for_save(weights_path)
        _refuse_overwrite(model_dir, "model")
        save_optimizer = optimizer is not None and optimizer_path is not None
        if save_optimizer:
            assert optimizer_path is not None
            _refuse_overwrite(Path(os.fspath(optimizer_path)) / OPTIMIZER_SUBDIR, "optimizer")
        elif optimizer is not None or scheduler is not None:
            logger.info("Optimizer/scheduler state not saved: pass both optimizer and optimizer_path to save it.")

        self.update_checkpointer_config(
            {**cfg.checkpointer_updates(is_peft=is_peft), "model_state_dict_keys": self.model_state_dict_keys},
            checkpoint_root=_infer_checkpoint_root(weights_path),
        )
        beside = tokenizer if tokenizer_path is None else None
        checkpointer.save_model(model, os.fspath(model_dir.parent), peft_config=peft_config, tokenizer=beside)
        if beside is not None and not self._checkpointer_saves_tokenizer(checkpointer.config):
            self._save_tokenizer(beside, model_dir)
        if save_optimizer:
            assert optimizer_path is not None
            checkpointer.save_optimizer(optimizer, model, os.fspath(optimizer_path), scheduler=scheduler)
        if tokenizer is not None and tokenizer_path is not None:
            self._save_tokenizer(tokenizer, Path(os.fspath(tokenizer_path)))
        if tokenizer is not None:
            _wait_for_rank0()

    @staticmethod
    def _peft_mode(cfg: CheckpointingConfig, lora_enabled: bool, peft_config: PeftConfig | None) -> bool:
        is_peft = bool(lora_enabled) or cfg.is_peft
        if is_peft and peft_config is None:
            raise ValueError(
                "Saving a LoRA/PEFT adapter needs its peft_config (nemo_automodel PeftConfig); "
                "pass peft_config=..., or save the full model with lora_enabled=False and is_peft=False."
            )
        if not is_peft and peft_config is not None:
            raise ValueError(
                "peft_config was given but neither lora_enabled nor checkpointing_cfg.is_peft is set; "
                "pass lora_enabled=True to save the adapter, or drop peft_config to save the full model."
            )
        return is_peft

    @staticmethod
    def _checkpointer_saves_tokenizer(config: NemoCheckpointingConfig) -> bool:
        """Whether nemo_automodel's addons write the tokenizer themselves (safetensors or PEFT saves)."""
        _, _, filesystem = nemo_checkpoint_modules()
        return bool(config.is_peft or config.model_save_format == filesystem.SerializationFormat.SAFETENSORS)

    @staticmethod
    def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
        if _is_rank0():
            directory.mkdir(parents=True, exist_ok=True)
            tokenizer.save_pretrained(os.fspath(directory))

    # ------------------------------------------------------------------- load

    def load_checkpoint(
        self,
        model: nn.Module,
        weights_path: str,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_path: str | None = None,
        scheduler: LRScheduler | None = None,
    ) -> None:
        """Load a checkpoint into the model using Automodel Checkpointer.

        Detects the saved format (safetensors or torch_save, full model or PEFT
        adapter) from the files, configures the checkpointer to match (creating it if
        needed), checks the checkpoint's tensor names against the expected keys, then
        loads. Optimizer and scheduler state are loaded when ``optimizer`` and
        ``optimizer_path`` are given.

        Args:
            model: The model to load weights into.
            weights_path: Path to the checkpoint weights (as given to ``save_checkpoint``,
                or its ``model`` subdirectory).
            optimizer: Optional optimizer to load state into.
            optimizer_path: Optional path to optimizer checkpoint.
            scheduler: Optional learning rate scheduler.

        Raises:
            CheckpointNotFoundError: Missing or empty weights or optimizer directory.
            UnrecognizedCheckpointFormatError: No known checkpoint layout in the directory.
            CheckpointKeyMismatchError: The checkpoint lacks expected keys or carries
                unexpected ones; nothing is loaded.
        """
        fmt, is_peft = detect_checkpoint_format(os.fspath(weights_path))
        model_dir = model_dir_for_load(weights_path)
        optimizer_root = (
            _optimizer_root_for_load(optimizer_path) if optimizer is not None and optimizer_path is not None else None
        )
        keys = self.model_state_dict_keys if self.model_state_dict_keys is not None else model_state_dict_keys(model)
        validate_checkpoint_keys(
            os.fspath(model_dir),
            read_checkpoint_keys(model_dir),
            expected_checkpoint_keys(keys, is_peft=is_peft),
            model=model,
        )
        checkpointer = self._configure_for_load(fmt, is_peft, weights_path)
        checkpointer.load_model(model, os.fspath(model_dir))
        if optimizer_root is not None:
            checkpointer.load_optimizer(optimizer, model, optimizer_root, scheduler=scheduler)
        elif scheduler is not None:
            logger.info("Scheduler state not loaded: it lives with the optimizer; pass optimizer and optimizer_path.")

    def _configure_for_load(self, fmt: str, is_peft: bool, weights_path: str) -> Checkpointer:
        """Create or update the checkpointer for the detected format; return it."""
        updates: dict[str, Any] = {"model_save_format": fmt, "is_peft": is_peft}
        root = _infer_checkpoint_root(weights_path)
        if self.checkpointer is None:
            self.init_checkpointer(config_updates={**updates, "save_consolidated": False}, checkpoint_root=root)
        else:
            self.update_checkpointer_config(config_updates=updates, checkpoint_root=root)
        return self._require_checkpointer("load a checkpoint")
