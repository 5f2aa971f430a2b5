"""The hook plugin manager, and the one helper through which the refit pipeline notifies it.

Hook plugins come from the entry-point group ``ckpt_core.hooks``; set
``CKPT_CORE_DISABLE_PLUGIN_AUTOLOAD=1`` to load none. A hook plugin that fails to import is
reported with a ``HookPluginWarning`` naming it and its cause (and listed by
``hook_plugin_failures()``); it never stops a refit or the other observers.
"""

from __future__ import annotations

import functools
import os
import warnings
from importlib import metadata

import pluggy

from ckpt_core import hookspecs
from ckpt_core.stats import RefitContext, RefitStats, Role

HOOKS_ENTRY_POINT_GROUP = "ckpt_core.hooks"
DISABLE_AUTOLOAD_ENV = "CKPT_CORE_DISABLE_PLUGIN_AUTOLOAD"

_failures: dict[str, str] = {}


class HookPluginWarning(UserWarning):
    """A hook plugin registered in ``ckpt_core.hooks`` could not be loaded."""


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager of observer hooks, with entry-point plugins loaded once."""
    manager = pluggy.PluginManager("ckpt_core")
    manager.add_hookspecs(hookspecs)
    if os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip() not in ("", "0"):
        return manager
    for ep in metadata.entry_points(group=HOOKS_ENTRY_POINT_GROUP):
        if manager.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
            manager.register(plugin, name=ep.name)
        except Exception as exc:
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "<unknown>"
            reason = f"{type(exc).__name__}: {exc} (from {dist}, target {ep.value})"
            _failures[ep.name] = reason
            warnings.warn(
                f"ckpt_core hook plugin {ep.name!r} was not loaded: {reason}",
                HookPluginWarning,
                stacklevel=2,
            )
    return manager


def hook_plugin_failures() -> dict[str, str]:
    """Hook plugins that failed to load, by entry-point name, with the cause."""
    plugin_manager()
    return dict(_failures)


class RefitNotifier:
    """Calls the observer hooks for one worker; what the pipeline uses, never the hooks directly.

    Hook calls are skipped entirely while no plugin implements them, so an unobserved refit
    pays nothing per bucket.
    """

    def __init__(self, backend: str, role: Role, rank: int) -> None:
        self._hook = plugin_manager().hook
        self.backend = backend
        self.role = role
        self.rank = rank

    def context(self, refit_index: int) -> RefitContext:
        return RefitContext(self.backend, self.role, self.rank, refit_index)

    def started(self, context: RefitContext) -> None:
        if self._hook.ckpt_core_refit_started.get_hookimpls():
            self._hook.ckpt_core_refit_started(context=context)

    def bucket_sent(self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
        if self._hook.ckpt_core_bucket_sent.get_hookimpls():
            self._hook.ckpt_core_bucket_sent(
                context=context, bucket_index=bucket_index, nbytes=nbytes, num_chunks=num_chunks
            )

    def bucket_received(
        self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int
    ) -> None:
        if self._hook.ckpt_core_bucket_received.get_hookimpls():
            self._hook.ckpt_core_bucket_received(
                context=context, bucket_index=bucket_index, nbytes=nbytes, num_chunks=num_chunks
            )

    def finished(self, context: RefitContext, stats: RefitStats) -> None:
        if self._hook.ckpt_core_refit_finished.get_hookimpls():
            self._hook.ckpt_core_refit_finished(context=context, stats=stats)

    def failed(self, context: RefitContext, error: BaseException) -> None:
        if self._hook.ckpt_core_refit_failed.get_hookimpls():
            self._hook.ckpt_core_refit_failed(context=context, error=error)
