"""Streaming received weights into a live vLLM model.

vLLM's layerwise reload (``vllm.model_executor.model_loader.reload``, the machinery behind its
own ``reload_weights``) restores each layer's checkpoint-format parameters, lets
``model.load_weights`` fill them, and re-runs the layer's post-load processing (repacking,
quantization) as soon as every weight of that layer arrived. So a refit streams: a layer is
processed while later batches are still on the wire, and the model is never held twice. Send a
layer's weights together (Hugging Face state-dict order does): vLLM buffers the weights of each
layer that is not complete yet.

Borrowed batches (the engine's ``borrow_received_tensors``) go in without a copy of their own:
a borrowed tensor is valid only until the next batch is asked for, and vLLM copies a complete
layer's weights into the model at once, but keeps the weights of a layer still waiting for
more. :func:`own_pending_weights`, called at every batch boundary, clones exactly those.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ckpt_vllm.errors import IncompleteRefitError, RolloutLoadError

logger = logging.getLogger(__name__)


class _TrackedWeights:
    """Iterates ``weights`` once, remembering the last name handed to vLLM and whether an
    exception came from the source (the transport) rather than from vLLM's loaders. ``seen``
    (shared by every load of one update) refuses a name that arrives twice."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], seen: set[str]) -> None:
        self._weights = weights
        self.last: tuple[str, torch.Tensor] | None = None
        self.count = 0
        self.nbytes = 0
        self.source_failed = False
        self._seen = seen

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        source = iter(self._weights)
        while True:
            try:
                name, tensor = next(source)
            except StopIteration:
                return
            except BaseException:
                self.source_failed = True
                raise
            if name in self._seen:
                raise RolloutLoadError(f"weight {name!r} arrived twice in one refit")
            self._seen.add(name)
            self.last = (name, tensor)
            self.count += 1
            self.nbytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def describe_last(self) -> str:
        if self.last is None:
            return "before the first weight"
        name, tensor = self.last
        dtype = str(tensor.dtype).removeprefix("torch.")
        return f"at weight {name!r} (shape {list(tensor.shape)}, {dtype})"


class LayerwiseLoad:
    """One weight update of a live vLLM model: :meth:`start`, then :meth:`load` once or more
    (each a stream of weights, loaded as they arrive), then :meth:`finish`.

    ``model`` and ``vllm_config`` are the worker's (``model_runner.get_model()`` and its
    ``vllm_config``). Errors raised by a stream itself (a transport's ``TransferError``...)
    propagate unchanged; a weight vLLM refuses raises :class:`RolloutLoadError` naming it; an
    update that leaves any parameter of the model without a weight raises
    :class:`IncompleteRefitError` at :meth:`finish`. After any error the model's layerwise
    state is closed (the next update starts clean), but its weights are not a model: a mix of
    two versions, and in modules vLLM had begun to rebuild, possibly memory nothing was written
    to. The caller must treat the engine as not current until an update succeeds.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model: Any = model  # a vLLM model: it has load_weights
        self.vllm_config = vllm_config
        self.count = 0
        self.nbytes = 0
        self._seen: set[str] = set()
        self._loaded: set[str] = set()
        self._restored: set[str] = set()
        self._reports_loaded = True  # every load so far said which parameters it filled
        self._open = False

    def start(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model)
        # The parameters a refit must bring are those of the checkpoint format vLLM restored
        # for the reload that the model still has once processed (see finish()).
        self._restored = _parameter_names(self.model)
        self._open = True

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Load ``weights`` as they arrive; returns (tensors, bytes) of this stream."""
        from vllm.config import set_current_vllm_config

        if not self._open:
            raise RolloutLoadError("no weight update is open on this worker: start one first")
        tracked = _TrackedWeights(weights, self._seen)
        with set_current_vllm_config(self.vllm_config):
            try:
                loaded = self.model.load_weights(tracked)
            except BaseException as exc:
                cleanup = self.abandon()
                if tracked.source_failed or isinstance(exc, (RolloutLoadError, KeyboardInterrupt)):
                    raise
                raise RolloutLoadError(
                    f"vLLM could not load the refit {tracked.describe_last()}: {exc}"
                    + (f" ({cleanup})" if cleanup else "")
                ) from exc
        if loaded is None:
            self._reports_loaded = False
        else:  # models that report what they loaded (all of vLLM's built-in ones)
            self._loaded.update(loaded)
        self.count += tracked.count
        self.nbytes += tracked.nbytes
        return tracked.count, tracked.nbytes

    def finish(self) -> None:
        """Close the update: refused with :class:`IncompleteRefitError` (the state closed all
        the same) when a parameter or part of a fused one got no weight."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._open:
            raise RolloutLoadError("no weight update is open on this worker: start one first")
        partial = _partly_loaded_modules(self.model)
        if partial:
            self.abandon()
            shown = "; ".join(partial[:6]) + (f"; and {len(partial) - 6} more" if len(partial) > 6 else "")
            raise IncompleteRefitError(
                f"the refit brought {self.count} weights but left {len(partial)} module(s) partly loaded "
                f"(a part of a fused weight such as q/k/v or gate/up is missing): {shown}"
            )
        with set_current_vllm_config(self.vllm_config):
            try:
                finalize_layerwise_reload(self.model, self.vllm_config.model_config)
            finally:
                self._open = False
        if self._reports_loaded:
            # Not what post-load processing makes (the scales of an online-quantized layer),
            # nor what it drops (an FP8 model's attention kv-cache scales, which the checkpoint
            # need not have: vLLM then keeps their defaults).
            expected = self._restored & _parameter_names(self.model)
            missing = sorted(expected - {checkpoint_name(name) for name in self._loaded})
            if missing:
                shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
                raise IncompleteRefitError(
                    f"the refit brought {self.count} weights but none for {len(missing)} of the model's "
                    f"{len(expected)} parameters: {shown}"
                )

    def abandon(self) -> str:
        """Close vLLM's layerwise state after a failure; "" or what went wrong doing so (the
        failure stays the error to report; this is said beside it). Idempotent."""
        if not self._open:
            return ""
        self._open = False
        cleanup = _finalize_after_failure(self.model, self.vllm_config)
        if cleanup:
            logger.error("%s", cleanup)
        return cleanup


def own_pending_weights(model: torch.nn.Module, lent_storages: set[int]) -> int:
    """Replace with clones the tensors vLLM's layerwise reload still holds, for layers not
    complete yet, that view one of ``lent_storages`` (storage ``data_ptr()`` values); returns the
    bytes cloned.

    Call it once vLLM took every tensor of a borrowed batch and before the next batch is asked
    for (which refills the buffers the borrowed tensors view), with the storages of that
    batch's lent tensors (those the engine's ``lends`` accepts). What vLLM keeps past the
    call is then memory of its own: the weights of the layers open at the boundary, which an
    owning receive would have kept as well; weights of layers that completed within the batch
    were copied into the model by vLLM and are never copied here.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    cloned = 0
    for module in model.modules():
        for _, bound in get_layerwise_info(module).loaded_weights:  # (param name, loader arguments)
            for key, value in bound.arguments.items():
                if (
                    isinstance(value, torch.Tensor)
                    and not value.is_meta
                    and value.untyped_storage().data_ptr() in lent_storages
                ):
                    bound.arguments[key] = value.clone()
                    cloned += value.numel() * value.element_size()
    return cloned


def _partly_loaded_modules(model: torch.nn.Module) -> list[str]:
    """Modules vLLM's layerwise reload still waits on with some but not all of their elements
    loaded. vLLM marks a fused parameter (``qkv_proj``) loaded once any part of it arrived, and
    its finalize would build such a module with the missing part uninitialized; a vocabulary
    layer may legitimately leave its padding rows unloaded."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    partial = []
    for name, module in model.named_modules():
        info = get_layerwise_info(module)
        if not info.can_load() or is_deferred_attention_layer(module):
            continue
        total, done = int(info.load_numel_total or 0), int(info.load_numel)
        if 0 < done < total - _padding_elements(module):
            partial.append(f"{name or type(module).__name__} ({done} of {total} elements)")
    return partial


def _padding_elements(module: torch.nn.Module) -> int:
    """Elements of a vocabulary-parallel layer past the checkpoint's vocabulary (padding and
    added-vocabulary rows), which no checkpoint weight fills."""
    indices = getattr(module, "shard_indices", None)
    dim = getattr(module, "embedding_dim", None)
    if indices is None or not isinstance(dim, int):
        return 0
    return int(indices.num_elements_padded - indices.num_org_elements) * dim


def _finalize_after_failure(model: torch.nn.Module, vllm_config: Any) -> str:
    """Close vLLM's layerwise state after a failed load; "" or what went wrong doing so."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    try:
        with set_current_vllm_config(vllm_config):
            finalize_layerwise_reload(model, vllm_config.model_config)
    except Exception as exc:  # noqa: BLE001 - reported beside the load's own error
        return f"closing vLLM's layerwise reload failed too ({type(exc).__name__}: {exc}): restart the engine"
    return ""


def _parameter_names(model: torch.nn.Module) -> set[str]:
    """The model's parameters by the names its checkpoint gives them (see :func:`checkpoint_name`)."""
    return {checkpoint_name(name) for name, _ in model.named_parameters()}


def checkpoint_name(name: str) -> str:
    """The checkpoint's name of module or parameter ``name`` of a model vLLM may have wrapped
    to serve LoRA adapters: without the wrappers' ``base_layer`` (``qkv_proj.base_layer.weight``
    is the checkpoint's ``qkv_proj.weight``, module ``qkv_proj.base_layer`` its ``qkv_proj``)."""
    return name.replace(".base_layer.", ".").removesuffix(".base_layer")
