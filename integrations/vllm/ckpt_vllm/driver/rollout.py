"""``VllmRollout``: the driver's side of refits into one running vLLM engine (``vllm.LLM``).

It drives vLLM's own weight-transfer calls (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) into the ``"ckpt"``
backend (:mod:`ckpt_vllm.weight_transfer.worker_engine`), plus the worker extension's calls for
what that API does not say (:mod:`ckpt_vllm.weight_transfer.extension`: metadata before init,
reports, status, discard). It turns a failure into one
:class:`~ckpt_core.orchestration.coordinator.RefitFailedError` naming every failed rank,
commits a refit's version only when every rank loaded all of it, resets vLLM's prefix cache
before that, and refuses to generate from weights that are not current (``allow_stale=True``
overrides: the caller decides).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_core.errors import (
    EngineOptionError,
    InvalidArgumentError,
    LifecycleError,
    TransferTimeoutError,
    UnknownBackendError,
)
from ckpt_core.options import MAX_TIMEOUT_S, check_bool, check_bucket_size, check_count, check_positive_number
from ckpt_core.orchestration.coordinator import CallResult, RefitFailedError
from ckpt_vllm.errors import StaleWeightsError
from ckpt_vllm.plugin import BACKEND_NAME

WORKER_EXTENSION = "ckpt_vllm.weight_transfer.extension.CkptEngineWorkerExtension"
"""The worker extension class, by name (``worker_extension_cls``)."""

VLLM_ENGINE_ARGS: dict[str, Any] = {
    "worker_extension_cls": WORKER_EXTENSION,
    "weight_transfer_config": {"backend": BACKEND_NAME},
}
"""What to add to the ``LLM``'s arguments for :class:`VllmRollout`: ``LLM(model,
**VLLM_ENGINE_ARGS)``."""


class VllmRollout:
    """Refits of one vLLM engine built with :data:`VLLM_ENGINE_ARGS` (the worker extension and
    the ``"ckpt"`` weight-transfer backend).

    ``rank_offset`` is the rollout rank of this engine's rank 0 among all rollout workers of
    the refit (several engines, data-parallel replicas, each take a range). ``rpc_timeout_s``
    bounds each call to the workers (vLLM's multiprocess executor enforces it; with a single
    worker process vLLM ignores it, and the backend's ``timeout_s`` bounds each wait inside);
    keep it well above the backend's ``timeout_s`` and a whole refit's time, so that a lost
    peer surfaces as the backend's typed error. A call that times out makes this object refuse
    every later call (vLLM may deliver the late reply to the next one): restart the engine.

    ``host_pool_bytes`` (default 0: off) is how much freed received-tensor memory ckpt-core
    may keep in each worker for the next refit. vLLM copies every tensor into the model and
    lets it go, so the pool buys little here and costs resident memory: measured on a 124 MB
    model, the worker's peak during a refit was 135 MiB over its resident state without the
    pool, about 200 MiB with it.

    Arguments are checked before the engine is called, each error naming the argument and the
    value: ``backend`` is a non-empty name (``UnknownBackendError``, as the registry says);
    ``bucket_size_bytes`` an int >= 1 (``EngineOptionError``, as ``create_checkpoint_engine``
    says); the options are checked as engine options are (``EngineOptionError``):
    ``engine_kwargs`` a mapping with string keys (its options are the backend's, checked by it
    on every rank), ``rank_offset`` and ``host_pool_bytes`` ints >= 0, ``verify`` a bool,
    ``rpc_timeout_s`` a finite number > 0 of at most 30 days; last, ``llm`` must have
    ``collective_rpc`` (``InvalidArgumentError``), and each of its ranks the extension and the
    backend (``RefitFailedError`` naming the rank).
    """

    def __init__(
        self,
        llm: Any,
        *,
        backend: str,
        bucket_size_bytes: int,
        engine_kwargs: dict[str, Any] | None = None,
        rank_offset: int = 0,
        verify: bool = False,
        rpc_timeout_s: float = 900.0,
        host_pool_bytes: int = 0,
    ) -> None:
        if not isinstance(backend, str) or not backend:
            raise UnknownBackendError(f"VllmRollout: backend must be a non-empty string, got {backend!r}")
        check_bucket_size(bucket_size_bytes, owner="VllmRollout")
        if engine_kwargs is not None and (
            not isinstance(engine_kwargs, Mapping) or not all(isinstance(key, str) for key in engine_kwargs)
        ):
            raise EngineOptionError(
                f"VllmRollout: engine_kwargs must be a dict of option name (str) to value, got {engine_kwargs!r}"
            )
        rpc_timeout_s = check_positive_number("VllmRollout", "rpc_timeout_s", rpc_timeout_s, MAX_TIMEOUT_S)
        check_bool("VllmRollout", "verify", verify)
        check_count("VllmRollout", "rank_offset", rank_offset)
        check_count("VllmRollout", "host_pool_bytes", host_pool_bytes)
        if not callable(getattr(llm, "collective_rpc", None)):
            raise InvalidArgumentError(
                f"VllmRollout: llm must be a vllm.LLM built with **VLLM_ENGINE_ARGS (it calls its collective_rpc), "
                f"got {type(llm).__name__}"
            )
        self.llm = llm
        self.rpc_timeout_s = rpc_timeout_s
        self.rank_offset = rank_offset
        self.verify = verify
        self.weight_version = 0
        self._current = True
        self._update_open = False
        self._unusable: str | None = None
        self._adapters: dict[str, tuple[int, str]] = {}  # name -> (id, version) every rank serves
        self._adapter_refits = 0
        self._options: dict[str, Any] = {
            "transport": backend,
            "bucket_size_bytes": bucket_size_bytes,
            "engine_kwargs": dict(engine_kwargs or {}),
            "rank_offset": rank_offset,
            "host_pool_bytes": host_pool_bytes,
            "verify": verify,
        }
        statuses = self.replies("status")  # every rank has ckpt-engine's weight-transfer engine
        failures = [r for r in statuses if not r.ok]
        if failures:
            raise RefitFailedError("ckpt_engine_status", failures)
        self.world_size = len(statuses)
        # Adapters the workers already serve (another driver refitted them): those every rank
        # serves at one version are this driver's to request too; its default versions go on
        # from theirs (a version names what vLLM caches, so none is given twice).
        served = [status.value.get("adapters", {}) for status in statuses]
        for name, adapter in served[0].items():
            if adapter["lora_id"] is not None and all(ranks.get(name) == adapter for ranks in served):
                self._adapters[name] = (adapter["lora_id"], adapter["version"])
                if adapter["version"].isdigit():
                    self._adapter_refits = max(self._adapter_refits, int(adapter["version"]))

    # -- calls to every rank -----------------------------------------------------------------
    def replies(self, method: str, *, timeout_s: float | None = None, **kwargs: Any) -> list[CallResult]:
        """The extension's ``ckpt_engine_<method>(**kwargs)`` on every rank: one result per
        rank, in rank order."""
        raw = self._rpc(f"ckpt_engine_{method}", timeout_s, kwargs)
        return [CallResult.from_reply(self.label(rank), reply) for rank, reply in enumerate(raw)]

    def _rpc(self, method: str, timeout_s: float | None, kwargs: dict[str, Any]) -> list[Any]:
        """``collective_rpc(method)``, bounded by ``timeout_s`` (default ``rpc_timeout_s``;
        vLLM raises ``TimeoutError`` past it)."""
        if self._unusable is not None:
            raise LifecycleError(self._unusable)
        timeout = self.rpc_timeout_s if timeout_s is None else max(timeout_s, self.rpc_timeout_s)
        try:
            return list(self.llm.collective_rpc(method, timeout=timeout, kwargs=kwargs))
        except TimeoutError as exc:
            # vLLM's workers may still answer this call, and a later call would read that
            # answer as its own: nothing more goes through this engine.
            self._unusable = (
                f"{method} did not answer within {timeout:g}s; vLLM may still deliver that reply to the next "
                "call, so this engine takes no more ckpt-engine calls: restart it"
            )
            self._current = False
            raise TransferTimeoutError(self._unusable) from exc

    def _vllm_call(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> None:
        """vLLM's worker method ``method`` on every rank; a failure as ``RefitFailedError``
        naming each rank that recorded one (all ranks, with vLLM's message, if none did)."""
        try:
            self._rpc(method, timeout_s, kwargs)
        except (TransferTimeoutError, LifecycleError):
            raise
        except Exception as exc:  # noqa: BLE001 - vLLM raises what its workers raised, as it likes
            try:
                statuses = self._values("status")
            except Exception:  # noqa: BLE001 - then vLLM's own message is all there is
                statuses = []
            failures = [
                CallResult.failure(self.label(rank), s["last_error"]["error_type"], s["last_error"]["message"])
                for rank, s in enumerate(statuses)
                if s["last_error"] is not None
            ]
            if not failures:
                failures = [
                    CallResult.failure(self.label(rank), type(exc).__name__, str(exc))
                    for rank in range(self.world_size)
                ]
            raise RefitFailedError(method, failures) from exc

    def label(self, rank: int) -> str:
        """How errors name this engine's worker ``rank``."""
        return f"vLLM rank {rank} (rollout rank {self.rank_offset + rank})"

    def _values(self, method: str, **kwargs: Any) -> list[Any]:
        results = self.replies(method, **kwargs)
        failures = [r for r in results if not r.ok]
        if failures:
            raise RefitFailedError(f"ckpt_engine_{method}", failures)
        return [r.value for r in results]

    # -- the lifecycle -----------------------------------------------------------------------
    def prepare(self) -> list[Any]:
        """A fresh engine on every rank, and each rank's ``prepare()`` metadata in rank order:
        the rollout entries to append after the policy entries."""
        return self._values("prepare", init_info=dict(self._options))

    def init(self, *, train_world_size: int, rollout_world_size: int, metadata: list[Any]) -> None:
        """Connect every rank (``init_weight_transfer_engine`` with every worker's metadata;
        run it while the policy ranks run ``init_policy_process_group``)."""
        self._init(
            {"train_world_size": train_world_size, "rollout_world_size": rollout_world_size, "metadata": metadata}
        )

    def connect(
        self,
        rendezvous: str,
        *,
        train_world_size: int,
        rollout_world_size: int | None = None,
        rendezvous_timeout_s: float = 300.0,
    ) -> None:
        """Connect every rank through a metadata rendezvous (``"host:port"`` of a
        :class:`~ckpt_core.orchestration.rendezvous.MetadataRendezvous`) instead of
        :meth:`prepare` and :meth:`init`: each rank prepares a fresh engine and meets the
        ``train_world_size`` policy ranks there (they call
        :func:`~ckpt_core.orchestration.rendezvous.exchange_metadata` with their entries).
        ``rollout_world_size`` (default: this engine's ranks) counts every engine's;
        ``rendezvous_timeout_s`` bounds each rank's wait there (the backend's own ``timeout_s``
        is an engine option, in ``engine_kwargs``)."""
        self._init(
            {
                "rendezvous": rendezvous,
                "train_world_size": train_world_size,
                "rollout_world_size": rollout_world_size,
                "rendezvous_timeout_s": rendezvous_timeout_s,
            }
        )

    def _init(self, peers: dict[str, Any]) -> None:
        self._vllm_call("init_weight_transfer_engine", init_info={**self._options, **peers})

    def refit(self, *, refit_index: int = 0) -> list[dict[str, Any]]:
        """Receive one refit on every rank (run it while the policy ranks send); returns each
        rank's report. Only when every rank loaded all of it is vLLM's prefix cache reset and
        the new version committed; otherwise the engine stays not current and this raises
        ``RefitFailedError`` naming each failed rank (then set up again, refit).
        ``refit_index`` (an int >= 0) counts the refits since ``init``, as the policy ranks do:
        it is put in the reports."""
        _check_index("refit_index", refit_index)
        reports = self.receive(refit_index=refit_index)
        self.commit()
        return reports

    def receive(self, *, refit_index: int = 0) -> list[dict[str, Any]]:
        """The first half of :meth:`refit`: receive and load on every rank, commit nothing
        (vLLM's update stays open until :meth:`commit` or :meth:`discard`)."""
        _check_index("refit_index", refit_index)
        self.mark_not_current()
        if not self._update_open:
            self._vllm_call("start_weight_update")
            self._update_open = True
        try:
            self._vllm_call("update_weights", update_info={})
        except RefitFailedError:
            # vLLM closes the update of each worker whose update failed; a rank that succeeded
            # still has it open, and finish closes it there (and fails on the others).
            self._update_open = False
            try:
                self._rpc("finish_weight_update", None, {})
            except Exception:  # noqa: BLE001 - the update's failure is the one to report
                pass
            raise
        return [{**report, "refit_index": refit_index} for report in self._values("report")]

    def mark_not_current(self) -> None:
        """From now until the next commit, :meth:`generate` refuses (a refit is starting)."""
        self._current = False

    def commit(self, *, weight_version: int | None = None) -> None:
        """Reset vLLM's prefix cache (its cached keys and values came from the old weights),
        then close vLLM's update on every rank and make ``weight_version`` (default: one more
        than the last) the engine's version. :meth:`refit` calls it; a coordinator calls it
        after checking digests. Refused, before anything is reset, on a rank that did not load
        the whole refit. ``weight_version`` is an int >= 0 (``InvalidArgumentError`` otherwise)."""
        if weight_version is not None:
            _check_index("weight_version", weight_version)
        version = self.weight_version + 1 if weight_version is None else weight_version
        unloaded = [
            CallResult.failure(
                self.label(rank),
                "LifecycleError",
                "has no completely loaded refit to commit"
                + (f" (last error: {s['last_error']['message']})" if s["last_error"] else ""),
            )
            for rank, s in enumerate(self._values("status"))
            if not (s["loaded"] and self._update_open)
        ]
        if unloaded:
            raise RefitFailedError("commit", unloaded)
        if not self.llm.reset_prefix_cache():
            raise LifecycleError(
                "vLLM refused to reset its prefix cache (requests are still running); the new weights "
                "are loaded but not committed: finish or abort the requests, then call commit() again"
            )
        self._finish()
        self.llm.update_weight_version(str(version))
        self.weight_version = version
        self._current = True

    def discard(self) -> None:
        """Reject the refit loaded by :meth:`receive` on every rank: it stays loaded in the
        model but not current, and :meth:`commit` refuses it (a coordinator calls this when
        digests or tensor counts differ from what was sent). Refit again to be current."""
        self.mark_not_current()
        self._values("discard")
        if self._update_open:
            self._finish()

    def _finish(self) -> None:
        self._update_open = False
        # vLLM removes every adapter here; each loads again from memory at its next request.
        self._vllm_call("finish_weight_update")

    def reset(self) -> None:
        """Drop every rank's engine after a failure (then ``prepare``/``init`` again)."""
        self.finalize()

    def finalize(self) -> None:
        """Close an update left open, then ``finalize()`` every rank's engine."""
        if self._update_open:
            self._finish()
        self._vllm_call("shutdown_weight_transfer_engine")

    def status(self) -> list[dict[str, Any]]:
        """Each rank's status
        (:meth:`ckpt_vllm.weight_transfer.worker_engine.CkptWeightTransferEngine.status`)."""
        return self._values("status")

    # -- LoRA adapters -----------------------------------------------------------------------
    def refit_adapter(
        self, name: str, *, lora_id: int, config: dict[str, Any], version: str | None = None
    ) -> list[dict[str, Any]]:
        """Receive one refit on every rank as LoRA adapter ``name`` (PEFT tensor names and
        ``config``, its PEFT ``LoraConfig`` fields: ``r``, ``lora_alpha``, ``target_modules``)
        and serve it from memory under ``lora_id`` (an int >= 1, kept across its versions),
        replacing its previous version; run it while the policy ranks send the adapter's
        tensors. The model's weights and the weight version are untouched. Each rank's
        account of what it serves. A bad adapter is refused by every rank
        (``RefitFailedError`` carrying each rank's ``AdapterError``) and its previous version
        keeps serving; if ranks ended at different versions (a transport failure on some),
        :meth:`lora_request` refuses the adapter until a refit of it succeeds."""
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"refit_adapter: name must be a non-empty string, got {name!r}")
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise InvalidArgumentError(f"refit_adapter: lora_id must be an int >= 1 (vLLM's), got {lora_id!r}")
        if not isinstance(config, Mapping):
            raise InvalidArgumentError(
                f"refit_adapter: config must be a dict of PEFT LoraConfig fields, got {config!r}"
            )
        self._adapter_refits += 1
        version = f"{self._adapter_refits}" if version is None else str(version)
        call = {"name": name, "lora_id": lora_id, "config": dict(config), "version": version}
        try:
            reports = self._values("receive_adapter", **call)
        except RefitFailedError:
            served = {s.get("adapters", {}).get(name, {}).get("version") for s in self._values("status")}
            if len(served) != 1 or None in served:  # the ranks disagree: no version is served everywhere
                self._adapters.pop(name, None)
            raise
        self._adapters[name] = (lora_id, version)
        return reports

    def lora_request(self, name: str) -> Any:
        """vLLM's ``LoRARequest`` for adapter ``name`` as every rank serves it (its path names the
        version and is never read); ``LifecycleError`` for an adapter not served everywhere."""
        from ckpt_vllm.model.lora import lora_request

        if name not in self._adapters:
            raise LifecycleError(
                f"adapter {name!r} is not served by every rank (never refitted, removed, or its last refit failed on "
                f"some): refit it with refit_adapter; served: {sorted(self._adapters)}"
            )
        lora_id, version = self._adapters[name]
        return lora_request(name, lora_id, version)

    def remove_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` on every rank."""
        self._adapters.pop(name, None)
        self._values("remove_adapter", name=name)

    # -- generation --------------------------------------------------------------------------
    @property
    def is_current(self) -> bool:
        """True when the weights are the last committed version on every rank."""
        return self._current

    def generate(self, *args: Any, allow_stale: bool = False, **kwargs: Any) -> Any:
        """``llm.generate(*args, **kwargs)``, refused with :class:`StaleWeightsError` while the
        weights are not current (a refit failed or is running), unless ``allow_stale`` (a bool:
        a truthy string would generate from stale weights by mistake)."""
        if not isinstance(allow_stale, bool):
            raise InvalidArgumentError(f"VllmRollout.generate: allow_stale must be True or False, got {allow_stale!r}")
        if not self._current and not allow_stale:
            raise StaleWeightsError(
                f"the engine's weights are not current (last committed version {self.weight_version}; a refit "
                "since then failed or did not finish): refit again, or pass allow_stale=True"
            )
        return self.llm.generate(*args, **kwargs)


def _check_index(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"VllmRollout: {name} must be an int >= 0, got {value!r}")
