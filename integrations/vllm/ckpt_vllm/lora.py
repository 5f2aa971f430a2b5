"""LoRA adapters served from memory: an adapter received by a refit is installed into a vLLM
worker's LoRA manager with no file written, under the name and id its caller chose, replacing
the version installed before.

vLLM 0.32 loads adapters only from a path (``LoRARequest(lora_path=...)``); its worker's LoRA
manager, though, takes any ``LoRAModel`` it is given, and a request naming an adapter id the
worker holds never reads the path. So each rank builds the ``LoRAModel`` from the received
tensors (``LoRAModel.from_lora_tensors``, with vLLM's own config checks, ``PEFTHelper``), swaps it
in for the old version (registered, activated into its slot, pinned in the worker's adapter
cache so that eviction never sends vLLM to the path), and keeps the tensors it was built from, so
that a version that fails to install puts the previous one back. Requests name the adapter with
:func:`lora_request`, whose path (never read) carries the version: vLLM keys its prefix cache by
the path, so no request reuses the keys and values of another version.

What is checked before anything changes (:class:`AdapterError`, naming the weight or module):
the PEFT config (``r``, ``lora_alpha``, ``target_modules``; vLLM's own limits, such as
``max_lora_rank``), every weight named ``<module>.lora_A.weight`` or ``<module>.lora_B.weight``
with both present per module, their ranks equal to ``r``, each module one the model has, and
the shapes against the model's layer (``A: [r, in_features]``, ``B: [out_features, r]``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ckpt_vllm.errors import AdapterError

PATH_SCHEME = "ckpt-engine://"
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class InstalledAdapter:
    """What a rank serves under one adapter name."""

    name: str
    lora_id: int
    version: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # as received (the LoRAModel is built from copies)

    def describe(self) -> dict[str, Any]:
        return {
            "lora_id": self.lora_id,
            "version": self.version,
            "tensors": len(self.tensors),
            "bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
        }


def lora_request(name: str, lora_id: int, version: str) -> Any:
    """vLLM's ``LoRARequest`` for an adapter installed from memory (its path is never read:
    it names the version, which keys vLLM's prefix cache)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, f"{PATH_SCHEME}{name}@{version}")


def check_adapter(
    tensors: dict[str, torch.Tensor], config: dict[str, Any], model: Any, packed: dict[str, list[str]]
) -> None:
    """Refuse, with :class:`AdapterError`, an adapter ``model`` (vLLM's, its LoRA layers
    wrapped) cannot serve as its config says; ``packed``: the model's packed modules
    (``qkv_proj`` -> ``q_proj, k_proj, v_proj``)."""
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"the adapter's config needs 'r', its rank, a positive int; got {rank!r}")
    for key in ("lora_alpha", "target_modules"):
        if key not in config:
            raise AdapterError(f"the adapter's config needs {key!r} (a PEFT LoraConfig's fields); got {sorted(config)}")
    if not tensors:
        raise AdapterError("the adapter has no weights")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            raise AdapterError(f"{name}: not a LoRA weight (names end in {' or '.join(_SUFFIXES)})")
        modules.setdefault(name.removesuffix(suffix), {})[suffix] = tensor
    for module, parts in modules.items():
        missing = [s for s in _SUFFIXES if s not in parts]
        if missing:
            raise AdapterError(f"{module}: the adapter has no {missing[0].lstrip('.')} for it")
        a, b = parts[".lora_A.weight"], parts[".lora_B.weight"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not of rank {rank} "
                "(lora_A [r, in_features], lora_B [out_features, r], r from the config)"
            )
        expected = _layer_shape(model, module, packed)
        if (a.shape[1], b.shape[0]) != expected:
            raise AdapterError(
                f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the model's layer "
                f"({expected[0]} in, {expected[1]} out)"
            )


def _layer_shape(model: Any, module: str, packed: dict[str, list[str]]) -> tuple[int, int]:
    """``module``'s (in_features, out_features) as a checkpoint holds it, from vLLM's layer
    (a packed one for its part)."""
    path = module.removeprefix(_PEFT_PREFIX)
    parent, _, leaf = path.rpartition(".")
    owner = next(((key, parts.index(leaf)) for key, parts in packed.items() if leaf in parts), None)
    vllm_path = f"{parent}.{owner[0]}" if owner is not None else path
    try:
        layer = model.get_submodule(vllm_path)
    except AttributeError:
        raise AdapterError(f"{module}: the adapter targets a module this model does not have") from None
    base = getattr(layer, "base_layer", layer)
    if not hasattr(base, "input_size"):
        raise AdapterError(f"{module}: the model's {vllm_path} is not a layer vLLM serves LoRA on")
    if owner is None:
        return int(base.input_size), int(base.output_size)
    index = owner[1]
    if hasattr(base, "total_num_kv_heads"):  # q, k, v: the checkpoint's sizes, before any head replication
        heads = [base.total_num_heads, base.total_num_kv_heads, base.total_num_kv_heads]
        widths = [base.head_size, base.head_size, base.v_head_size]
        return int(base.input_size), int(heads[index] * widths[index])
    return int(base.input_size), int(base.output_sizes[index])


def install_adapter(worker: Any, installed: dict[str, InstalledAdapter], adapter: InstalledAdapter) -> None:
    """Serve ``adapter`` on this rank (``worker``: vLLM's), in place of the version of the same
    name in ``installed`` (updated on success). On any failure the previous version serves
    again, and :class:`AdapterError` says why."""
    manager = _lora_manager(worker)
    adapters = manager._adapter_manager
    previous = installed.get(adapter.name)
    if previous is not None and previous.lora_id != adapter.lora_id:
        raise AdapterError(
            f"adapter {adapter.name!r} is served under id {previous.lora_id}; a new version keeps its id, "
            f"got {adapter.lora_id}"
        )
    taken = {a.lora_id: a.name for a in installed.values()}
    if taken.get(adapter.lora_id, adapter.name) != adapter.name:
        raise AdapterError(
            f"id {adapter.lora_id} serves adapter {taken[adapter.lora_id]!r}: give {adapter.name!r} another"
        )
    check_adapter(adapter.tensors, adapter.config, adapters.model, adapters.packed_modules_mapping)
    model = _lora_model(manager, adapter)
    try:
        _swap_in(adapters, model)
    except Exception as exc:
        if previous is not None:
            _swap_in(adapters, _lora_model(manager, previous))
        raise AdapterError(f"adapter {adapter.name!r}: vLLM did not take it: {type(exc).__name__}: {exc}") from exc
    installed[adapter.name] = adapter


def remove_adapter(worker: Any, installed: dict[str, InstalledAdapter], name: str) -> None:
    """Stop serving adapter ``name`` on this rank (``KeyError`` for one it does not serve)."""
    adapter = installed.pop(name)
    _lora_manager(worker)._adapter_manager.remove_adapter(adapter.lora_id)


def _lora_manager(worker: Any) -> Any:
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise AdapterError("this vLLM engine serves no LoRA adapters: build it with enable_lora=True")
    return manager


def _lora_model(manager: Any, adapter: InstalledAdapter) -> Any:
    """vLLM's ``LoRAModel`` of ``adapter``, its config checked by vLLM's own rules."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    try:
        peft = PEFTHelper.from_dict({**adapter.config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        peft.validate_legal(manager.lora_config)
    except ValueError as exc:
        raise AdapterError(f"adapter {adapter.name!r}: {exc}") from None
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # vLLM scales lora_B in place when it registers the model: build it from copies.
    copies = {name: tensor.detach().clone() for name, tensor in adapter.tensors.items()}
    return LoRAModel.from_lora_tensors(
        adapter.lora_id,
        copies,
        peft,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def _swap_in(adapters: Any, model: Any) -> None:
    """Register ``model`` under its id in place of what is there, copy it into a slot, and pin
    it in the adapter cache (an evicted adapter would be read from its path, which does not
    exist)."""
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed

    lora_id = model.id
    with gpu_sync_allowed():
        if adapters.get_adapter(lora_id) is not None:
            adapters.remove_adapter(lora_id)
        if len(adapters) + 1 > adapters.capacity:
            adapters.remove_oldest_adapter()
        adapters.add_adapter(model)
        try:
            adapters.activate_adapter(lora_id)
            adapters._pin_lora_in_cpu_cache(lora_id)
        except Exception:
            adapters.remove_adapter(lora_id)
            raise
