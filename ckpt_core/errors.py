"""The exception types ckpt-core raises.

Every error a caller can act on has its own type, and each also derives from the builtin a
caller would naturally catch (``ValueError`` for bad input, ``TimeoutError`` for a missed
deadline, ...), so ``except ValueError`` keeps working for code that does not know ours.
"""

from __future__ import annotations


class CheckpointEngineError(Exception):
    """Base class of every error raised by ckpt-core and its transports."""


# --- registry ------------------------------------------------------------------------------


class UnknownBackendError(CheckpointEngineError, LookupError, ValueError):
    """No installed backend has the requested name.

    Also a ``ValueError``, as NeMo RL's ``create_checkpoint_engine`` raises for an unknown name,
    and its message starts the same way (``Unknown checkpoint-engine backend 'name'``)."""


class BackendImportError(CheckpointEngineError, ImportError):
    """A backend is registered, but importing its entry point failed."""


class DuplicateBackendError(CheckpointEngineError, LookupError):
    """Two installed distributions register the same backend name."""


class NotAnEngineError(CheckpointEngineError, TypeError):
    """A backend target resolved to something that is not a ``CheckpointEngine`` subclass."""


class InvalidArgumentError(CheckpointEngineError, ValueError):
    """An argument is outside its contract: a rank, a world size, a metadata list. (A bad
    engine option, the bucket size included, is its subclass ``EngineOptionError``.)"""


class WeightLayoutError(InvalidArgumentError):
    """A destination layout (``ckpt_core.refit.layout``) is malformed, does not cover every weight,
    or does not fit the weights the sender yields (a layout of another model)."""


class EngineOptionError(InvalidArgumentError, TypeError):
    """An engine option is unknown, missing, or of the wrong type or value; the bucket size
    (``bucket_size_bytes``) included, wherever it is checked (registry, engine, CLI, Ray).

    Also an ``InvalidArgumentError`` and a ``ValueError`` (what a bad bucket size used to be)
    and a ``TypeError`` (what Python raises for an unknown keyword argument), so ``except``
    clauses written for any of them keep working."""


class HookValidationError(CheckpointEngineError, ValueError):
    """A hook plugin implements a hook that does not exist, or with arguments it does not have."""


class BackendUnavailableError(CheckpointEngineError, RuntimeError):
    """The backend is installed but cannot run here (no CUDA, no NCCL library, ...)."""


# --- data ---------------------------------------------------------------------------------


class UnsupportedTensorError(CheckpointEngineError, TypeError):
    """A weight cannot be moved as plain bytes (quantized, sparse, not a tensor, ...)."""


class ChunkStreamError(CheckpointEngineError, ValueError):
    """A chunk stream is malformed: a gap, an overlap, a mismatched chunk, or a cut-off tensor."""


class WireFormatError(CheckpointEngineError, ValueError):
    """Bytes received from a peer do not decode to a valid header or metadata entry."""


class IntegrityError(CheckpointEngineError):
    """A bucket's payload does not match the checksum its header carries."""


# --- lifecycle and transfer ---------------------------------------------------------------


class LayoutUnavailableError(CheckpointEngineError, NotImplementedError):
    """``get_target_weight_layout()`` was asked for with ``shard_expert_weights=True``, but the
    engine has no destination layout (NeMo RL's base raises ``NotImplementedError`` there)."""


class LifecycleError(CheckpointEngineError, RuntimeError):
    """A method was called out of order (receive before init, send after finalize, ...)."""


class TransferError(CheckpointEngineError, RuntimeError):
    """A refit failed while moving data; the refit is void and must be retried in full."""


class PeerLostError(TransferError):
    """A peer process went away (closed its connection or died) during a refit."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A wait exceeded the engine's ``timeout_s``."""


class RemoteRefitError(TransferError):
    """The sending side aborted the refit (for example its weights generator raised)."""


class AuthenticationError(CheckpointEngineError, PermissionError):
    """A peer failed the shared-token challenge at rendezvous."""


class OutOfMemoryError(CheckpointEngineError, MemoryError):
    """Memory the engine needs cannot be allocated: its bucket buffers, or a received tensor."""
