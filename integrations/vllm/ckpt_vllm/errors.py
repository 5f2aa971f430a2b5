"""Errors of the vLLM adapter; each is also a ckpt-core error, so one ``except`` catches both."""

from __future__ import annotations

from ckpt_core.errors import CheckpointEngineError, InvalidArgumentError, LifecycleError


class RolloutLoadError(CheckpointEngineError, ValueError):
    """vLLM refused a received weight (a name the model does not have, a wrong shape, a weight
    sent twice). The message names the weight; the engine is marked not current."""


class IncompleteRefitError(CheckpointEngineError, ValueError):
    """A refit ended without a weight for some of the model's parameters; they are named. The
    engine is marked not current: a partial refit would mix two versions of the model."""


class StaleWeightsError(LifecycleError):
    """Generation was asked of an engine whose weights are not the last committed version (a
    refit failed, or one is in progress). Refit again, or pass ``allow_stale=True``."""


class WorkersFailedError(CheckpointEngineError, RuntimeError):
    """A weight-transfer call failed on some of a vLLM engine's workers; the message names each
    one and its error (each worker's ``ckpt_engine_status`` has it too). Raised by the engine's
    last worker only, for all of them (see
    :func:`ckpt_vllm.weight_transfer.worker_engine.settle`)."""


class AdapterError(InvalidArgumentError):
    """A LoRA adapter a rank cannot serve (the message names the weight, module or setting):
    nothing was installed, and the version installed before (if any) keeps serving."""
