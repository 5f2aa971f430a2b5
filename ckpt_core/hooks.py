"""The hook plugin manager, and the one helper through which the refit pipeline notifies it.

Hook plugins come from the entry-point group ``ckpt_core.hooks``; set
``CKPT_CORE_DISABLE_PLUGIN_AUTOLOAD=1`` to load none, or name some in
``CKPT_CORE_BLOCK_PLUGINS`` (comma-separated) to skip those. A hook plugin that fails to
import, or implements a hook that does not exist (a misspelled name), is not registered: it is
reported with a ``HookPluginWarning`` naming it and the cause (and listed by
``hook_plugin_failures()``), and never stops a refit or the other observers. At run time,
:func:`register` adds an observer object with the same check, raising ``HookValidationError``.
"""

from __future__ import annotations

import difflib
import functools
import os
import warnings
from importlib import metadata
from typing import Any

import pluggy

from ckpt_core import hookspecs
from ckpt_core.blocklist import blocked_plugins
from ckpt_core.errors import HookValidationError
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
    blocked = blocked_plugins()
    for ep in metadata.entry_points(group=HOOKS_ENTRY_POINT_GROUP):
        if ep.name in blocked or manager.get_plugin(ep.name) is not None:
            continue
        try:
            _register_checked(manager, ep.load(), ep.name)
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


def register(plugin: Any, name: str | None = None) -> None:
    """Register an observer (a module, class or object with ``@ckpt_core.hookimpl`` methods).

    Raises ``HookValidationError``, registering nothing, if one of its implementations names a
    hook that does not exist or takes an argument the hook does not pass.
    """
    _register_checked(plugin_manager(), plugin, name)


def _register_checked(manager: pluggy.PluginManager, plugin: Any, name: str | None) -> None:
    try:
        manager.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:  # an argument the hook does not pass
        raise HookValidationError(str(exc)) from exc
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        message = _unknown_hook_message(manager, plugin, exc)
        manager.unregister(plugin)
        raise HookValidationError(message) from exc


def _unknown_hook_message(manager: pluggy.PluginManager, plugin: Any, exc: Exception) -> str:
    known = sorted(name for name in dir(hookspecs) if name.startswith("ckpt_core_"))
    unknown = sorted(caller.name for caller in (manager.get_hookcallers(plugin) or []) if caller.name not in known) or [
        str(exc)
    ]
    hints = []
    for hook in unknown:
        close = difflib.get_close_matches(hook, known, n=1)
        hints.append(f"{hook!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"implements hooks that do not exist: {', '.join(hints)}; the hooks are {', '.join(known)}"


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

    def bucket_received(self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
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
