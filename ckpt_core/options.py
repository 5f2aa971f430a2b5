"""Engine options, declared once: a schema per engine class that every consumer reads.

An engine class carries one :class:`OptionSchema` (``BucketedEngine.options``): per option its
name, default, how a value is checked, its bounds or choices, a one-line doc and whether every
worker of a refit must use the same value. Subclasses inherit it and ``extend`` or ``replace``
it; the engine's constructor parses its keyword arguments through it, and the registry, the
CLI (``ckpt-engine list``), the Ray launcher, the vLLM adapter, the settings-agreement check at
init, the docs and the conformance kit all read it (:func:`schema_of`). A bad value is an
``EngineOptionError`` naming the owner, the option, the value and what is accepted.

The single-value checks (:func:`check_bool`, :func:`check_choice`,
:func:`check_positive_number`, :func:`check_bucket_size`) also serve options of what drives
engines (the vLLM adapter); transport authors reach all of this through ``ckpt_core.transport``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import textwrap
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ckpt_core.errors import EngineOptionError

__all__ = [
    "MAX_TIMEOUT_S",
    "REQUIRED",
    "Option",
    "OptionSchema",
    "OptionValues",
    "check_bool",
    "check_bucket_size",
    "check_choice",
    "check_count",
    "check_kwargs_shape",
    "check_positive_number",
    "schema_of",
]


MAX_TIMEOUT_S = 30 * 86400.0
"""Longest ``timeout_s`` (30 days). Gloo and the store keep deadlines in nanoseconds of an
int64, which overflows past about 9.2e9 s (and ``timedelta`` past 8.6e13 s)."""


# --- single values ---------------------------------------------------------------------------


def _prefix(owner: str) -> str:
    return f"{owner}: " if owner else ""


def check_positive_number(owner: str, option: str, value: Any, maximum: float = math.inf) -> float:
    """``value`` as a finite float in (0, ``maximum``], else ``EngineOptionError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise EngineOptionError(f"{_prefix(owner)}{option} must be a finite number > 0, got {value!r}")
    if value > maximum:
        raise EngineOptionError(f"{_prefix(owner)}{option} must be at most {maximum:g}, got {value!r}")
    return float(value)


def check_choice(owner: str, option: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else ``EngineOptionError`` naming them."""
    if not isinstance(value, str) or value not in choices:
        raise EngineOptionError(
            f"{_prefix(owner)}{option} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return value


def check_bool(owner: str, option: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0, 1 or a string), else ``EngineOptionError``."""
    if not isinstance(value, bool):
        raise EngineOptionError(f"{_prefix(owner)}{option} must be True or False, got {value!r}")
    return value


def check_bucket_size(value: Any, *, owner: str = "", name: str = "bucket_size_bytes") -> int:
    """A bucket size: an ``int`` >= 1 (bytes; not a bool, float or string), else
    ``EngineOptionError`` (an ``InvalidArgumentError``, so a ``ValueError`` too). ``name`` is
    how the caller spells it (``bucket_size_bytes`` for the factory and configs,
    ``bucket_size`` for an engine's constructor)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineOptionError(f"{_prefix(owner)}{name} must be a positive int (bytes), got {value!r}")
    return value


def check_count(owner: str, option: str, value: Any) -> int:
    """``value`` if it is an ``int`` >= 0 (not a bool), else ``EngineOptionError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EngineOptionError(f"{_prefix(owner)}{option} must be an int >= 0, got {value!r}")
    return value


def check_kwargs_shape(engine_kwargs: Any) -> dict[str, Any]:
    """``engine_kwargs`` if it is a dict with string keys (option names), else
    ``EngineOptionError``; the names themselves are the schema's to check."""
    if not isinstance(engine_kwargs, dict):
        raise EngineOptionError(
            f"engine_kwargs must be a dict of option name to value, got {type(engine_kwargs).__name__}"
        )
    for key in engine_kwargs:
        if not isinstance(key, str):
            raise EngineOptionError(f"engine option names must be strings, got {key!r}")
    return engine_kwargs


# --- the schema -----------------------------------------------------------------------------


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""The ``default`` of an option that every caller must pass."""

Parse = Callable[["Option", str, Any], Any]
"""How an option's value is checked: ``(option, owner, value) -> parsed value``, raising
``EngineOptionError`` for a bad one; reads bounds and choices from ``option``."""


def _parse_bool(option: Option, owner: str, value: Any) -> bool:
    return check_bool(owner, option.name, value)


def _parse_number(option: Option, owner: str, value: Any) -> float:
    return check_positive_number(owner, option.name, value, option.maximum)


def _parse_size(option: Option, owner: str, value: Any) -> int:
    return check_bucket_size(value, owner=owner, name=option.name)


def _parse_choice(option: Option, owner: str, value: Any) -> Any:
    convert = option.convert
    if convert is not None and hasattr(convert, "parse"):  # an enum with a parse() of its own
        return convert.parse(value, owner=owner, choices=option.choices)
    chosen = check_choice(owner, option.name, value, option.choices)
    return convert(chosen) if convert is not None else chosen


def _parse_text(option: Option, owner: str, value: Any) -> str | None:
    if value is None and option.default is None:
        return None
    if not isinstance(value, str) or not value:
        raise EngineOptionError(f"{_prefix(owner)}{option.name} must be a {option.accepts}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Option:
    """One engine option. Build one with :meth:`flag`, :meth:`number`, :meth:`size`,
    :meth:`choice`, :meth:`text` or :meth:`custom`; narrow it in a subclass with
    :meth:`OptionSchema.replace`."""

    name: str
    default: Any
    """The value when the caller passes none (``REQUIRED``: the caller must pass one)."""
    doc: str
    """One line: what it does."""
    parse: Parse
    kind: str
    """What values are accepted, in words (``"bool"``, ``"number > 0"``); empty for a choice,
    whose choices say it (see :attr:`accepts`)."""
    choices: tuple[str, ...] = ()
    maximum: float = math.inf
    convert: Any = None
    """For a choice: the type its value becomes (an enum such as ``Topology``)."""
    agreed: bool = False
    """Whether every worker of one refit must use the same value (compared at init)."""
    argument: str | None = None
    """Where ``create_checkpoint_engine`` takes this option as an argument of its own (the bucket
    size: ``bucket_size_bytes``), that name; such an option is not an ``engine_kwargs`` key."""
    shown_default: str | None = None
    """The default as docs show it, where its value alone does not say it (``None`` meaning
    "the system temp directory")."""

    @property
    def accepts(self) -> str:
        """What values are accepted, in words: ``kind``, or a choice's choices."""
        if self.choices and not self.kind:
            return " | ".join(repr(choice) for choice in self.choices)
        return self.kind

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def spelled(self) -> str:
        """How a user sets it: ``engine_kwargs`` key, or the factory's own argument."""
        return self.argument or self.name

    def default_text(self) -> str:
        """The default as docs and ``ckpt-engine list`` show it: ``False``, ``300``, ``"cpu"``."""
        if self.shown_default is not None:
            return self.shown_default
        if self.required:
            return "required"
        return _literal(self.default)

    def check(self, owner: str, value: Any) -> Any:
        """``value`` parsed, or ``EngineOptionError``."""
        return self.parse(self, owner, value)

    def describe(self) -> dict[str, Any]:
        """As plain JSON data (``ckpt-engine list --json``)."""
        return {
            "name": self.name,
            "default": self.default_text(),
            "accepts": self.accepts,
            "agreed": self.agreed,
            "doc": self.doc,
            **({"argument": self.argument} if self.argument else {}),
        }

    # --- constructors ---------------------------------------------------------------------

    @classmethod
    def flag(cls, name: str, default: bool, doc: str, *, agreed: bool = False) -> Option:
        """``True`` or ``False``."""
        return cls(name, default, doc, _parse_bool, "bool", agreed=agreed)

    @classmethod
    def number(
        cls, name: str, default: float, doc: str, *, maximum: float = math.inf, kind: str | None = None
    ) -> Option:
        """A finite number > 0 (at most ``maximum``), as a float; ``kind`` words it for docs."""
        if kind is None:
            kind = "number > 0" if maximum == math.inf else f"number in (0, {maximum:g}]"
        return cls(name, default, doc, _parse_number, kind, maximum=maximum)

    @classmethod
    def size(cls, name: str, default: Any, doc: str, *, agreed: bool = False, argument: str | None = None) -> Option:
        """A byte count: an int >= 1."""
        return cls(name, default, doc, _parse_size, "int >= 1 (bytes)", agreed=agreed, argument=argument)

    @classmethod
    def choice(
        cls, name: str, default: Any, choices: tuple[str, ...], doc: str, *, convert: Any = None, agreed: bool = False
    ) -> Option:
        """One of ``choices`` (strings); ``convert`` turns it into its type (an enum)."""
        choices = tuple(str(choice) for choice in choices)
        return cls(name, default, doc, _parse_choice, "", choices=choices, convert=convert, agreed=agreed)

    @classmethod
    def text(
        cls, name: str, default: str | None, doc: str, *, noun: str = "string", shown_default: str | None = None
    ) -> Option:
        """A non-empty string (``noun`` says what it holds: ``"address string"``); ``None`` too
        where that is the default."""
        kind = f"non-empty {noun}" + (" or None" if default is None else "")
        return cls(name, default, doc, _parse_text, kind, shown_default=shown_default)

    @classmethod
    def custom(
        cls,
        name: str,
        default: Any,
        doc: str,
        *,
        parse: Parse,
        kind: str,
        agreed: bool = False,
        shown_default: str | None = None,
    ) -> Option:
        """Any other option: ``parse(option, owner, value)`` checks and converts a value."""
        return cls(name, default, doc, parse, kind, agreed=agreed, shown_default=shown_default)


def _literal(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def _json_value(value: Any) -> Any:
    """A parsed value as plain JSON data (an enum as its value), for agreed settings."""
    return value.value if isinstance(value, enum.Enum) else value


class OptionValues(Mapping[str, Any]):
    """An engine's parsed options: by attribute (``values.timeout_s``) or by name."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy and pickle probe dunders before __init__ ran
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no option {name!r}; options: {', '.join(self._values)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("OptionValues are read-only")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"OptionValues({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"


class OptionSchema(Mapping[str, Option]):
    """An engine class's options, in order, by name. Immutable: :meth:`extend` and
    :meth:`replace` return a new schema, for a subclass to assign as its own ``options``."""

    def __init__(self, *options: Option) -> None:
        by_name: dict[str, Option] = {}
        for option in options:
            if option.name in by_name:
                raise ValueError(f"option {option.name!r} is declared twice; use replace() to change it")
            by_name[option.name] = option
        self._options = by_name

    def __getitem__(self, name: str) -> Option:
        return self._options[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._options)

    def __len__(self) -> int:
        return len(self._options)

    def __repr__(self) -> str:
        return f"OptionSchema({', '.join(self._options)})"

    def extend(self, *options: Option) -> OptionSchema:
        """This schema plus ``options`` (new names only)."""
        return OptionSchema(*self._options.values(), *options)

    def replace(self, name: str, **changes: Any) -> OptionSchema:
        """This schema with option ``name``'s fields changed (a default, narrower choices, a doc)."""
        if name not in self._options:
            raise KeyError(f"no option {name!r} to replace; options: {', '.join(self._options)}")
        return OptionSchema(
            *(dataclasses.replace(o, **changes) if o.name == name else o for o in self._options.values())
        )

    def names(self) -> list[str]:
        """The options a caller passes in ``engine_kwargs`` (not those with an argument of their
        own in ``create_checkpoint_engine``, such as the bucket size)."""
        return [name for name, option in self._options.items() if option.argument is None]

    def closest(self, name: str) -> str | None:
        """The accepted option name closest to a misspelled ``name``, if any is close."""
        close = difflib.get_close_matches(name, self.names(), n=1)
        return close[0] if close else None

    def check_kwargs(self, owner: str, engine_kwargs: Any) -> None:
        """Check ``engine_kwargs`` names (not values) before an engine is built:
        ``EngineOptionError`` for a non-dict, a non-string key, an option that is an argument
        of its own (``bucket_size``), an unknown name (naming the accepted ones and the
        closest) or a missing required one."""
        for key in check_kwargs_shape(engine_kwargs):
            option = self._options.get(key)
            if option is not None and option.argument is not None:
                raise EngineOptionError(
                    f"pass {key} as create_checkpoint_engine({option.argument}=...), not in engine_kwargs"
                )
        self._check_names(owner, engine_kwargs, "in engine_kwargs", skip_arguments=True)

    def _check_names(self, owner: str, given: Mapping[str, Any], where: str, *, skip_arguments: bool) -> None:
        for key in given:
            if key not in self._options:
                close = self.closest(key)
                hint = f" (did you mean {close!r}?)" if close else ""
                raise EngineOptionError(
                    f"{owner} has no option {key!r}{hint}. Accepted options: {', '.join(self.names()) or '(none)'}"
                )
        missing = [
            option.spelled
            for option in self._options.values()
            if option.required and option.name not in given and not (skip_arguments and option.argument)
        ]
        if missing:
            raise EngineOptionError(f"{owner} requires option(s) {', '.join(missing)} {where}")

    def parse(self, owner: str, given: Mapping[str, Any]) -> OptionValues:
        """Every option's value, checked: ``given``'s, or the default. ``EngineOptionError``
        for an unknown name (with the closest and the accepted ones), a missing required
        option, or the first bad value."""
        self._check_names(owner, given, "", skip_arguments=False)
        # Defaults go through their check too, so every value has its parsed type (a device
        # string becomes what the engine reads, a topology string a Topology).
        values = {name: option.check(owner, given.get(name, option.default)) for name, option in self._options.items()}
        return OptionValues(values)

    def agreed(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The values every worker must share (options declared ``agreed``), as JSON data."""
        return {name: _json_value(values[name]) for name, option in self._options.items() if option.agreed}

    def spellings(self) -> dict[str, str]:
        """Option name -> how a user sets it, where that differs (``bucket_size_bytes``)."""
        return {name: option.argument for name, option in self._options.items() if option.argument}

    def describe(self) -> list[dict[str, Any]]:
        """Every option as plain JSON data, in order."""
        return [option.describe() for option in self._options.values()]

    def docstring(self) -> str:
        """The options as a reST list, for an engine class's docstring."""
        lines = ["Options (generated from the class's ``options`` schema):", ""]
        for option in self._options.values():
            facts = [option.accepts, f"default ``{option.default_text()}``"]
            if option.argument:
                facts.append(f"passed as ``{option.argument}``")
            if option.agreed:
                facts.append("the same on every worker")
            lines.append(f"* ``{option.name}`` ({'; '.join(facts)}): {option.doc}")
        return "\n".join(lines)


def schema_of(engine_class: type) -> OptionSchema | None:
    """The options schema ``engine_class`` declares (``options``), or ``None`` for an engine
    that declares none (a plain ``CheckpointEngine``): its constructor then checks its own."""
    schema = getattr(engine_class, "options", None)
    return schema if isinstance(schema, OptionSchema) else None


def document_options(cls: type[Any]) -> None:
    """Append the options ``cls`` takes, generated from its schema, to its docstring (so
    ``help()`` and API docs list exactly what the constructor accepts)."""
    doc = cls.__dict__.get("__doc__") or ""
    marker = "Options (generated from"
    if marker in doc:
        doc = doc[: doc.index(marker)]
    doc = doc.rstrip()
    body = [line for line in doc.splitlines()[1:] if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in body), default=0)
    generated = textwrap.indent(cls.options.docstring(), " " * indent)
    cls.__doc__ = f"{doc}\n\n{generated}\n" if doc else generated
