"""Find backends by name through ``importlib.metadata`` entry points, importing them lazily.

A backend is a ``CheckpointEngine`` subclass that an installed distribution registers in the
entry-point group ``ckpt_core.backends``::

    [project.entry-points."ckpt_core.backends"]
    my_transport = "my_package.engine:MyTransportEngine"

Listing names imports nothing; resolving a name imports only that backend. A broken plugin is
reported (by name, with its cause and an install hint) and never stops another backend from
being selected. ``"module:ClassName"`` is accepted wherever a name is.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
from collections.abc import Callable
from importlib import metadata
from typing import Any

from ckpt_core.blocklist import BLOCK_ENV, blocked_plugins
from ckpt_core.contract import CheckpointEngine
from ckpt_core.errors import (
    BackendImportError,
    DuplicateBackendError,
    EngineOptionError,
    NotAnEngineError,
    UnknownBackendError,
)
from ckpt_core.options import check_bucket_size, check_kwargs_shape, schema_of
from ckpt_core.transport.capabilities import BackendCapabilities, declared_capabilities, unavailable_reason

ENTRY_POINT_GROUP = "ckpt_core.backends"

# Distributions of the backends this project ships, for install hints.
KNOWN_DISTRIBUTIONS = {
    "gloo_cpu": "ckpt-gloo-cpu",
    "nccl": "ckpt-nccl",
    "cuda_ipc": "ckpt-cuda-ipc",
}


@dataclasses.dataclass(frozen=True)
class BackendEntry:
    """One registration of a backend name, as an installed distribution declares it."""

    name: str
    target: str
    distribution: str
    version: str

    @property
    def install_hint(self) -> str:
        return f"pip install --force-reinstall {self.distribution}"


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """What ``list_backends`` reports about one registered backend name."""

    name: str
    distribution: str
    version: str
    target: str
    loads: bool
    error: str | None = None
    """Why it does not load (the import error, or a duplicate registration)."""
    unavailable_reason: str | None = None
    """Why it loads but cannot run on this machine; only filled with ``details=True``."""
    capabilities: BackendCapabilities | None = None
    """Only filled with ``details=True``."""
    options: tuple[dict[str, Any], ...] | None = None
    """Its options schema (``OptionSchema.describe()``: name, default, accepts, agreed, doc),
    ``None`` for an engine that declares none; only filled with ``details=True``."""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["capabilities"] = self.capabilities.to_dict() if self.capabilities else None
        data["options"] = list(self.options) if self.options is not None else None
        return data


def _entries() -> dict[str, list[BackendEntry]]:
    """Every registration in the group, by name, but those in ``CKPT_CORE_BLOCK_PLUGINS``.
    Reading metadata imports no plugin."""
    found: dict[str, list[BackendEntry]] = {}
    blocked = blocked_plugins()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in blocked:
            continue
        dist = ep.dist
        entry = BackendEntry(
            name=ep.name,
            target=ep.value,
            distribution=dist.metadata["Name"] if dist is not None else "<unknown>",
            version=dist.version if dist is not None else "<unknown>",
        )
        same_name = found.setdefault(ep.name, [])
        if entry not in same_name:  # one distribution seen twice on sys.path is one entry
            same_name.append(entry)
    return found


def backend_names() -> list[str]:
    """Names of the registered backends, sorted. Imports no backend."""
    return sorted(_entries())


def list_backends(*, details: bool = False) -> list[BackendInfo]:
    """Every registered backend with its distribution, version, target and load status.

    Checking the load status imports each backend (a failure is reported, not raised). With
    ``details=True`` each loadable backend's declared capabilities and whether it can run on
    this machine are filled in too.
    """
    infos = []
    for _, entries in sorted(_entries().items()):
        for entry in entries:
            infos.append(_describe(entry, duplicates=entries, details=details))
    return infos


def _describe(entry: BackendEntry, *, duplicates: list[BackendEntry], details: bool) -> BackendInfo:
    base: dict[str, Any] = dict(
        name=entry.name,
        distribution=entry.distribution,
        version=entry.version,
        target=entry.target,
    )
    if len(duplicates) > 1:
        return BackendInfo(**base, loads=False, error=_duplicate_message(entry.name, duplicates))
    try:
        engine_class = _load_target(entry.target, entry=entry)
    except (BackendImportError, NotAnEngineError) as exc:
        return BackendInfo(**base, loads=False, error=str(exc))
    if not details:
        return BackendInfo(**base, loads=True)
    schema = schema_of(engine_class)
    return BackendInfo(
        **base,
        loads=True,
        unavailable_reason=unavailable_reason(engine_class),
        capabilities=declared_capabilities(engine_class),
        options=tuple(schema.describe()) if schema is not None else None,
    )


def resolve_backend(backend: str) -> type[CheckpointEngine]:
    """The engine class registered as ``backend``, or named by ``"module:ClassName"``.

    Raises ``UnknownBackendError`` (listing what is installed and what failed to import),
    ``DuplicateBackendError``, ``BackendImportError`` or ``NotAnEngineError``.
    """
    if not isinstance(backend, str) or not backend:
        raise UnknownBackendError(f"backend must be a non-empty string, got {backend!r}")
    if ":" in backend:
        return _load_target(backend, entry=None)
    entries = _entries()
    registered = entries.get(backend)
    if not registered:
        raise UnknownBackendError(_unknown_message(backend, entries))
    if len(registered) > 1:
        raise DuplicateBackendError(_duplicate_message(backend, registered))
    return _load_target(registered[0].target, entry=registered[0])


def _load_target(target: str, *, entry: BackendEntry | None) -> type[CheckpointEngine]:
    module_name, _, attribute = target.partition(":")
    origin = f"backend {entry.name!r} ({entry.distribution} {entry.version})" if entry else repr(target)
    if not module_name or not attribute:
        raise NotAnEngineError(f"{origin}: target {target!r} is not of the form 'module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        hint = f"; to repair it: {entry.install_hint}" if entry else ""
        raise BackendImportError(
            f"{origin}: importing {module_name!r} failed: {type(exc).__name__}: {exc}{hint}",
            name=module_name,
        ) from exc
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise NotAnEngineError(f"{origin}: module {module_name!r} has no attribute {attribute!r}")
    if not (inspect.isclass(obj) and issubclass(obj, CheckpointEngine)):
        raise NotAnEngineError(f"{origin}: {target!r} is {obj!r}, not a subclass of ckpt_core.CheckpointEngine")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise NotAnEngineError(f"{origin}: {target!r} is abstract; it lacks {missing}")
    return obj


def _unknown_message(backend: str, entries: dict[str, list[BackendEntry]]) -> str:
    if backend in blocked_plugins():
        return (
            f"Unknown checkpoint-engine backend {backend!r}: it is blocked by {BLOCK_ENV}="
            f"{os.environ.get(BLOCK_ENV, '')!r}; take it out of that list to use it."
        )
    lines = [f"Unknown checkpoint-engine backend {backend!r}: no installed backend has that name."]
    if backend in KNOWN_DISTRIBUTIONS:
        lines.append(f"It ships as a plugin: pip install {KNOWN_DISTRIBUTIONS[backend]}")
    close = difflib.get_close_matches(backend, list(entries), n=1)
    if close:
        lines.append(f"Did you mean {close[0]!r}?")
    loaded, failed = [], []
    for name, registered in sorted(entries.items()):
        if len(registered) > 1:
            failed.append(f"  {name}: {_duplicate_message(name, registered)}")
            continue
        try:
            _load_target(registered[0].target, entry=registered[0])
            loaded.append(f"  {name} ({registered[0].distribution} {registered[0].version})")
        except (BackendImportError, NotAnEngineError) as exc:
            failed.append(f"  {name}: {str(exc)}")
    lines.append("Installed backends:" if loaded else "Installed backends: none")
    lines.extend(loaded)
    if failed:
        lines.append("Registered but failing to load:")
        lines.extend(failed)
    lines.append("A class can also be named directly as 'module:ClassName'.")
    return "\n".join(lines)


def _duplicate_message(name: str, entries: list[BackendEntry]) -> str:
    owners = " and ".join(f"{e.distribution} {e.version} ({e.target})" for e in entries)
    return (
        f"backend name {name!r} is registered by more than one distribution: {owners}; "
        "uninstall all but one, or select one by 'module:ClassName'"
    )


def build_engine(backend: str, *, bucket_size_bytes: int, engine_kwargs: dict[str, Any]) -> CheckpointEngine:
    """Resolve ``backend``, check the options against its schema, and construct it."""
    check_bucket_size(bucket_size_bytes)
    engine_class = resolve_backend(backend)
    check_engine_kwargs(engine_class, engine_kwargs)
    construct: Callable[..., CheckpointEngine] = engine_class  # the ABC itself declares no options
    return construct(bucket_size=bucket_size_bytes, **engine_kwargs)


def check_engine_kwargs(engine_class: type[CheckpointEngine], engine_kwargs: Any) -> None:
    """Check option names against ``engine_class``'s options schema before it is built.

    Raises ``EngineOptionError`` for a non-mapping, a non-string key, ``bucket_size`` passed as
    an option, an unknown option (naming the accepted ones and the closest match) or a missing
    required one. Values are checked when the engine parses them. An engine class that declares
    no schema (a plain ``CheckpointEngine``) checks its own keyword arguments.
    """
    schema = schema_of(engine_class)
    if schema is not None:
        schema.check_kwargs(engine_class.__name__, engine_kwargs)
        return
    for key in check_kwargs_shape(engine_kwargs):
        if key == "bucket_size":
            raise EngineOptionError(
                "pass bucket_size as create_checkpoint_engine(bucket_size_bytes=...), not in engine_kwargs"
            )


def create_checkpoint_engine(
    backend: str,
    *,
    bucket_size_bytes: int,
    engine_kwargs: dict[str, Any],
) -> CheckpointEngine:
    """Build the engine registered as ``backend`` (or given as ``"module:ClassName"``).

    ``engine_kwargs`` are checked against the engine class's options schema
    (:mod:`ckpt_core.options`) before it is called, and a bad ``bucket_size_bytes`` is an
    ``EngineOptionError`` like any bad option; the engine receives it as ``bucket_size``. See
    :func:`resolve_backend` for resolution and its errors.
    """
    return build_engine(backend, bucket_size_bytes=bucket_size_bytes, engine_kwargs=engine_kwargs)
