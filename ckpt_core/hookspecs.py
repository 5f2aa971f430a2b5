"""Hooks for observers of a refit (progress bars, metrics exporters, loggers).

Each hook below is a typed stub; its docstring is the contract. Implement any subset in a
module or class with ``@ckpt_core.hookimpl`` and register it in the entry-point group
``ckpt_core.hooks`` (autoloaded unless ``CKPT_CORE_DISABLE_PLUGIN_AUTOLOAD=1``) or at run time
with ``ckpt_core.hooks.register(obj)`` (which refuses a misspelled hook).

Hooks run on the worker's own thread, inside the refit: keep them cheap, and never raise
(an exception in a hook fails the refit it observes). Hooks are grouped by lifecycle stage.
"""

from __future__ import annotations

import pluggy

from ckpt_core.stats import RefitContext, RefitStats

hookspec = pluggy.HookspecMarker("ckpt_core")
hookimpl = pluggy.HookimplMarker("ckpt_core")


# --- a refit starts ----------------------------------------------------------------------


@hookspec
def ckpt_core_refit_started(context: RefitContext) -> None:
    """A worker began refit ``context.refit_index`` (a sender entered ``send_weights``, or a
    receiver began iterating ``receive_weight_batches``)."""


# --- buckets move ------------------------------------------------------------------------


@hookspec
def ckpt_core_bucket_sent(context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
    """The sender handed bucket ``bucket_index`` (``nbytes`` payload bytes holding
    ``num_chunks`` chunks) to the transport. Bytes may still be in flight."""


@hookspec
def ckpt_core_bucket_received(context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
    """A receiver holds bucket ``bucket_index`` whole, its header and checksum verified."""


# --- a refit ends ------------------------------------------------------------------------


@hookspec
def ckpt_core_refit_finished(context: RefitContext, stats: RefitStats) -> None:
    """The worker's part of the refit completed; ``stats`` has its bytes, tensors and timings.
    On a receiver, every tensor of the refit has been received and checked; the caller may
    not have taken the last batch yet (a receiver that owns its tensors ends the refit with
    it, see ``BucketedEngine.receive_weight_batches``)."""


@hookspec
def ckpt_core_refit_failed(context: RefitContext, error: BaseException) -> None:
    """The worker's part of the refit failed with ``error``, which is re-raised afterwards.
    The refit is void: the caller must finalize, re-initialize and refit in full."""
