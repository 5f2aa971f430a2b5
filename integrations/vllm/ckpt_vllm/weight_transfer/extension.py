"""The vLLM worker extension: what a driver needs of each worker that vLLM's weight-transfer API
does not say.

Refits themselves go through vLLM's own calls into
:class:`ckpt_vllm.weight_transfer.worker_engine.CkptWeightTransferEngine`
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``). A driver that orchestrates the seed lifecycle
itself (:class:`ckpt_vllm.VllmRollout`, a ``RefitCoordinator``) also needs each rank's
``prepare()`` metadata before init, the report of the refit it loaded, its status, and a way to
reject a loaded refit: those are the methods here, reached with
``collective_rpc("ckpt_engine_<name>", kwargs=...)``.

Give it to vLLM as ``LLM(..., **VLLM_ENGINE_ARGS)`` (this class as ``worker_extension_cls``,
with the ``"ckpt"`` weight-transfer backend). Names start with ``ckpt_engine_`` so they cannot
clash with vLLM's own (vLLM refuses an extension that shadows a worker attribute). Every method
returns a reply record, never raises: ``{"ok": True, "result": ...}`` or ``{"ok": False,
"error_type": ..., "message": ..., "traceback": ...}``, so the driver learns the outcome of every
rank, not only the first failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ckpt_core.errors import LifecycleError
from ckpt_core.orchestration.protocol import error_reply
from ckpt_vllm.model.lora import AdapterStore, HeldAdapter
from ckpt_vllm.plugin import BACKEND_NAME
from ckpt_vllm.weight_transfer.worker_engine import CkptInitInfo, CkptWeightTransferEngine


def _replying(method: Callable[..., Any]) -> Callable[..., dict[str, Any]]:
    """Run ``method``; its value or its exception as a plain reply record."""

    def replying(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return {"ok": True, "result": method(self, *args, **kwargs)}
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver
            return error_reply(exc)

    replying.__name__ = method.__name__
    replying.__qualname__ = method.__qualname__
    replying.__doc__ = method.__doc__
    return replying


class CkptEngineWorkerExtension:
    """Methods vLLM mixes into each of its workers (see the module docstring)."""

    # Set by vLLM's worker; declared for readers and type checkers.
    weight_transfer_engine: Any

    def _ckpt_transfer(self) -> CkptWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, CkptWeightTransferEngine):
            raise LifecycleError(
                f"this vLLM worker's weight-transfer engine is {type(engine).__name__}, not ckpt-engine's: build "
                f"the LLM with weight_transfer_config={{'backend': '{BACKEND_NAME}'}} (ckpt_vllm.VLLM_ENGINE_ARGS)"
            )
        return engine

    @_replying
    def ckpt_engine_prepare(self, *, init_info: dict[str, Any]) -> Any:
        """A fresh engine built from ``init_info``
        (:meth:`~ckpt_vllm.weight_transfer.worker_engine.CkptInitInfo.from_dict`, without the
        peers': those come with ``init_weight_transfer_engine``), and its metadata
        (:meth:`~ckpt_vllm.weight_transfer.worker_engine.CkptWeightTransferEngine.prepare`)."""
        engine = self._ckpt_transfer()
        return engine.prepare(CkptInitInfo.from_dict({**init_info, "metadata": None, "rendezvous": None}))

    @_replying
    def ckpt_engine_report(self) -> dict[str, Any] | None:
        """The report of the last refit this rank loaded (``None`` before any): tensors, bytes,
        the engine's statistics, digests (with ``verify``), bytes cloned while borrowing, seconds
        (wall, waiting for batches, and the CPU seconds of the worker's process), memory (RSS
        before, peak, heap trims)."""
        return self._ckpt_transfer().last_report

    @_replying
    def ckpt_engine_discard(self) -> dict[str, Any]:
        """Reject the refit loaded in the open update; its status after."""
        engine = self._ckpt_transfer()
        engine.discard()
        return engine.status()

    @_replying
    def ckpt_engine_status(self) -> dict[str, Any]:
        """This rank's status
        (:meth:`~ckpt_vllm.weight_transfer.worker_engine.CkptWeightTransferEngine.status`), with
        the adapters it holds in memory (:meth:`ckpt_vllm.model.lora.AdapterStore.describe`)."""
        status = self._ckpt_transfer().status()
        store = AdapterStore.find(self)
        return {**status, "adapters": store.describe() if store is not None else {}}

    @_replying
    def ckpt_engine_receive_adapter(
        self, *, name: str, config: dict[str, Any], version: str, lora_id: int | None = None
    ) -> dict[str, Any]:
        """Receive one refit as ``version`` of LoRA adapter ``name`` (PEFT tensor names,
        ``config`` its PEFT LoraConfig's fields), checked and held in memory
        (:class:`ckpt_vllm.model.lora.AdapterStore`); with ``lora_id``, served under it at once in
        place of the previous version, else when vLLM is asked to load its path (the server's
        ``/v1/load_lora_adapter``). The version received (``lora_id``, ``version``, tensors,
        bytes), this rank's ``seconds`` receiving it, checking and holding it, and installing it
        (0 without ``lora_id``), and the ``time.perf_counter`` stamps this call ``started_at``
        and ``ended_at`` on the rank (one clock for every process of a machine: a caller on it
        times the call's way in and out)."""
        started = time.perf_counter()
        tensors = self._ckpt_transfer().receive_adapter()
        received = time.perf_counter()
        store = AdapterStore.of(self)
        adapter = HeldAdapter(name, str(version), dict(config), tensors)
        store.hold(adapter)
        held = time.perf_counter()
        seconds = {"receive": received - started, "hold": held - received, "install": 0.0}
        if lora_id is not None:
            store.install(name, adapter.version, lora_id)
            seconds["install"] = time.perf_counter() - held
        stamps = {"started_at": started, "ended_at": time.perf_counter()}
        return {"lora_id": lora_id, **adapter.describe(), "seconds": seconds, **stamps}

    @_replying
    def ckpt_engine_remove_adapter(self, *, name: str) -> None:
        """Stop serving adapter ``name`` and drop what this rank holds of it (``KeyError`` for
        one it holds nothing of)."""
        AdapterStore.of(self).remove(name)
