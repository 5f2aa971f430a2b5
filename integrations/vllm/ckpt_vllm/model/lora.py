"""LoRA adapters served from memory: an adapter received by a refit is held by each vLLM worker
and served with no file written, replacing the version served before.

vLLM 0.32 loads adapters only from a path (``LoRARequest(lora_path=...)``, the server's
``/v1/load_lora_adapter``). Each rank therefore keeps the adapters it received in an
:class:`AdapterStore` and answers vLLM's own adapter loading (its LoRA manager's
``_load_adapter``) for paths of the form ``ckpt-engine://<name>@<version>`` from memory, by
building vLLM's ``LoRAModel`` from the held tensors (``LoRAModel.from_lora_tensors``, vLLM's
``PEFTHelper`` rules); every other path goes to vLLM's loader as before. Everything else is
vLLM's: its ``add_adapter`` swaps the new version in for the old one (load first, then replace,
so a version that fails to load leaves the old one serving), an adapter evicted from its caches
or removed at the end of a weight update (``finish_weight_update`` calls ``reset_lora_state``) is
loaded again from memory at its next request, and the server's ``/v1/load_lora_adapter``
(``load_inplace``) installs a held version on every rank at once, under the id the server keeps
for the name. The path carries the version, and vLLM keys its prefix cache by the path, so no
request reuses the keys and values of another version.

What is checked when an adapter arrives, before it can be served (:class:`AdapterError`, naming
the weight or module): the PEFT config (``r``, ``lora_alpha``, ``target_modules``; vLLM's own
limits, such as ``max_lora_rank``), every weight named ``<module>.lora_A.weight`` or
``<module>.lora_B.weight`` with both present per module, their ranks equal to ``r``, each module
one the model has, and the shapes against the model's layer (``A: [r, in_features]``,
``B: [out_features, r]``).
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
class HeldAdapter:
    """One version of one adapter as a rank received it."""

    name: str
    version: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]  # as received (each LoRAModel is built from copies)

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "tensors": len(self.tensors),
            "bytes": sum(t.numel() * t.element_size() for t in self.tensors.values()),
        }


def adapter_path(name: str, version: str) -> str:
    """The path vLLM is given for ``version`` of adapter ``name`` held in memory (never read
    from disk: :class:`AdapterStore` answers it)."""
    return f"{PATH_SCHEME}{name}@{version}"


def lora_request(name: str, lora_id: int, version: str) -> Any:
    """vLLM's ``LoRARequest`` for an adapter served from memory (its path names the version,
    which keys vLLM's prefix cache)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, adapter_path(name, version))


def check_adapter(
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    model: Any,
    packed: dict[str, list[str]],
    shapes: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Refuse, with :class:`AdapterError`, an adapter ``model`` (vLLM's, its LoRA layers
    wrapped) cannot serve as its config says; ``packed``: the model's packed modules
    (``qkv_proj`` -> ``q_proj, k_proj, v_proj``). ``shapes``: the layer shapes found for
    ``model`` so far, by module (read and added to: a worker's model does not change, and
    looking a layer up costs more than the rest of its checks)."""
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
        expected = shapes.get(module) if shapes is not None else None
        if expected is None:
            expected = _layer_shape(model, module, packed)
            if shapes is not None:
                shapes[module] = expected
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


class AdapterStore:
    """The adapters one vLLM worker holds in memory, and its answer to vLLM's adapter loading for
    their paths (module docstring). One per worker: :meth:`of`."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager  # vLLM's WorkerLoRAManager
        self._held: dict[str, dict[str, HeldAdapter]] = {}  # name -> version -> adapter
        self._loaded: dict[str, tuple[int, str]] = {}  # name -> (id, version) vLLM last loaded
        self._shapes: dict[str, tuple[int, int]] = {}  # module -> its layer's (in, out), as found

    _ATTRIBUTE = "_ckpt_engine_adapters"  # where a vLLM worker keeps its store

    @classmethod
    def find(cls, worker: Any) -> AdapterStore | None:
        """``worker``'s store, or ``None`` before its first adapter."""
        return getattr(worker, cls._ATTRIBUTE, None)

    @classmethod
    def of(cls, worker: Any) -> AdapterStore:
        """``worker``'s store (vLLM's worker), made on first use: from then on its LoRA manager
        loads ``ckpt-engine://`` paths from the store."""
        store = cls.find(worker)
        if store is None:
            manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
            if manager is None:
                raise AdapterError("this vLLM engine serves no LoRA adapters: build it with enable_lora=True")
            store = cls(manager)
            load_from_path = manager._load_adapter

            # vLLM's loader opens the path; ours builds the held version. Set on this one manager.
            def load_adapter(request: Any) -> Any:
                if str(request.lora_path).startswith(PATH_SCHEME):
                    return store.load(request)
                return load_from_path(request)

            manager._load_adapter = load_adapter
            setattr(worker, cls._ATTRIBUTE, store)
        return store

    def hold(self, adapter: HeldAdapter) -> None:
        """Keep ``adapter`` once it passed every check (module docstring). Of its name's older
        versions only the one vLLM loaded last stays: until every rank switched to the new one
        (the server's load), vLLM may need to load the old one again (after an eviction)."""
        if not adapter.version or "@" in adapter.version:
            raise AdapterError(f"an adapter's version is a non-empty string without '@', got {adapter.version!r}")
        loaded = self._loaded.get(adapter.name, (0, None))[1]
        if adapter.version == loaded:
            raise AdapterError(
                f"adapter {adapter.name!r} version {adapter.version!r} is the one served: give each refit a new "
                "version (vLLM keys its prefix cache by it, so a reused one would serve the old keys and values)"
            )
        check_adapter(adapter.tensors, adapter.config, self._manager._adapter_manager.model, self._packed, self._shapes)
        self._peft(adapter)
        versions = self._held.get(adapter.name, {})
        kept = {v: held for v, held in versions.items() if v == loaded}
        self._held[adapter.name] = {**kept, adapter.version: adapter}

    def install(self, name: str, version: str, lora_id: int) -> None:
        """Serve held ``version`` of ``name`` under ``lora_id`` now, through vLLM's own
        ``add_adapter`` (in place of the version served before, which serves on if this one
        fails). A name keeps its id across versions; an id serves one name."""
        previous = self._loaded.get(name)
        if previous is not None and previous[0] != lora_id:
            raise AdapterError(
                f"adapter {name!r} is served under id {previous[0]}; a new version keeps its id, got {lora_id}"
            )
        taken = {loaded_id: other for other, (loaded_id, _) in self._loaded.items()}
        if taken.get(lora_id, name) != name:
            raise AdapterError(f"id {lora_id} serves adapter {taken[lora_id]!r}: give {name!r} another")
        from vllm.lora.request import LoRARequest

        request = LoRARequest(name, lora_id, adapter_path(name, version), load_inplace=True)
        try:
            self._manager.add_adapter(request)
        except AdapterError:
            raise
        except Exception as exc:
            raise AdapterError(f"adapter {name!r}: vLLM did not take it: {type(exc).__name__}: {exc}") from exc

    def load(self, request: Any) -> Any:
        """vLLM's ``LoRAModel`` for ``request`` (a ``ckpt-engine://`` path), built from the held
        version it names; ``AdapterError`` for a version this rank does not hold."""
        name, _, version = str(request.lora_path).removeprefix(PATH_SCHEME).rpartition("@")
        adapter = self._held.get(name, {}).get(version)
        if adapter is None:
            held = sorted(self._held.get(name, {}))
            raise AdapterError(
                f"adapter {name!r} version {version!r} is not held in memory by this rank (held: {held}): "
                "refit the adapter again"
            )
        model = self._lora_model(adapter, request.lora_int_id)
        self._loaded[name] = (request.lora_int_id, version)
        return model

    def remove(self, name: str) -> None:
        """Stop serving adapter ``name`` on this rank and drop what it holds of it (``KeyError``
        for a name it holds nothing of)."""
        del self._held[name]
        loaded = self._loaded.pop(name, None)
        if loaded is not None:
            self._manager._adapter_manager.remove_adapter(loaded[0])

    def describe(self) -> dict[str, dict[str, Any]]:
        """Name -> the version vLLM last loaded on this rank (``lora_id``, ``version``, tensors,
        bytes); the newest held version for a name not loaded yet (``lora_id`` ``None``)."""
        described = {}
        for name, versions in self._held.items():
            lora_id, version = self._loaded.get(name, (None, list(versions)[-1]))
            described[name] = {"lora_id": lora_id, **versions[version].describe()}
        return described

    @property
    def _packed(self) -> dict[str, list[str]]:
        return self._manager._adapter_manager.packed_modules_mapping

    def _peft(self, adapter: HeldAdapter) -> Any:
        """vLLM's ``PEFTHelper`` of ``adapter``'s config, checked by vLLM's own rules."""
        from vllm.lora.peft_helper import PEFTHelper

        try:
            peft = PEFTHelper.from_dict(
                {**adapter.config, "vllm_max_position_embeddings": self._manager.max_position_embeddings}
            )
            peft.validate_legal(self._manager.lora_config)
        except ValueError as exc:
            raise AdapterError(f"adapter {adapter.name!r}: {exc}") from None
        return peft

    def _lora_model(self, adapter: HeldAdapter, lora_id: int) -> Any:
        from vllm.lora.lora_model import LoRAModel

        model = self._manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        dtype = self._manager.lora_config.lora_dtype
        # vLLM scales lora_B in place when it registers the model: it must get copies. Its own
        # cast to ``dtype`` makes one of a tensor of another dtype; any other is copied here.
        copies = {
            name: tensor if isinstance(dtype, torch.dtype) and tensor.dtype != dtype else tensor.detach().clone()
            for name, tensor in adapter.tensors.items()
        }
        return LoRAModel.from_lora_tensors(
            lora_id,
            copies,
            self._peft(adapter),
            device="cpu",
            dtype=dtype,
            model_vocab_size=self._manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
