"""Check a checkpoint's tensor names against the keys a model expects, before loading.

nemo_automodel loads PEFT adapters non-strictly and DCP ignores checkpoint entries
nobody asked for, so without this check a mismatched checkpoint loads partially and
silently. The comparison happens on names only (metadata reads, no tensor data).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ckpt_core.automodel.errors import CheckpointKeyMismatchError

__all__ = ["ADAPTER_KEY_MARKER", "expected_checkpoint_keys", "model_state_dict_keys", "validate_checkpoint_keys"]

#: Substring that marks LoRA/PEFT adapter tensors (nemo_automodel's own filter).
ADAPTER_KEY_MARKER = "lora_"
_EXTRA_STATE_SUFFIX = "_extra_state"
_LM_HEAD_SUFFIX = "lm_head.weight"


def model_state_dict_keys(model: nn.Module) -> list[str]:
    """The model's state dict keys under torch.distributed's canonical names.

    Uses ``get_model_state_dict`` so FSDP/DDP/compile wrappers do not leak into the
    names; the values (local shards) are not touched.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return list(get_model_state_dict(model).keys())


def _ties_embeddings(model: nn.Module | None) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False))


def expected_checkpoint_keys(keys: Iterable[str], *, is_peft: bool) -> set[str]:
    """The subset of a model's keys a checkpoint must hold.

    Module ``_extra_state`` entries are never required; a PEFT checkpoint holds only
    adapter (``lora_``) tensors.
    """
    wanted = {k for k in keys if not k.endswith(_EXTRA_STATE_SUFFIX)}
    if is_peft:
        wanted = {k for k in wanted if ADAPTER_KEY_MARKER in k}
    return wanted


def validate_checkpoint_keys(
    path: str,
    checkpoint_keys: Iterable[str],
    expected_keys: Iterable[str],
    *,
    model: nn.Module | None = None,
) -> None:
    """Raise unless ``checkpoint_keys`` and ``expected_keys`` name the same tensors.

    A tied ``lm_head.weight`` (``model.config.tie_word_embeddings``) may be absent from
    the checkpoint, since it is the embedding under another name.

    Raises:
        CheckpointKeyMismatchError: Listing the missing and the unexpected keys.
    """
    saved = {k for k in checkpoint_keys if not k.endswith(_EXTRA_STATE_SUFFIX)}
    expected = set(expected_keys)
    missing = expected - saved
    if _ties_embeddings(model):
        missing = {k for k in missing if not k.endswith(_LM_HEAD_SUFFIX)}
    unexpected = saved - expected
    if missing or unexpected:
        raise CheckpointKeyMismatchError(path, missing, unexpected)
