"""Every option table in the docs agrees with the options schema it documents.

A table lists an engine's ``engine_kwargs`` options (``| `name` | `default` | meaning |``); it
fails here when it misses an option of the schema, lists one the schema does not have, or shows
another default than the schema's (``Option.default_text()``). The README's backends table is
checked for each backend's topologies. Engine docstrings need no check: their option list is
generated from the schema (``BucketedEngine.__init_subclass__``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckpt_core.options import OptionSchema
from ckpt_core.registry import resolve_backend
from ckpt_core.transport import BucketedEngine

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\|\s*`(?P<name>[a-z_]+)`\s*\|\s*(?P<default>[^|]+?)\s*\|")


def option_table(text: str, after: str = "| option | default |") -> dict[str, str]:
    """The first option table after the line starting with ``after``: name -> default cell,
    backticks dropped."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(after))
    rows: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"not an option row: {line!r}"
        assert match["name"] not in rows, f"{match['name']!r} is listed twice"
        rows[match["name"]] = match["default"].replace("`", "")
    return rows


def expected(schema: OptionSchema, names: list[str] | None = None) -> dict[str, str]:
    return {name: schema[name].default_text() for name in (names or schema.names())}


def mismatches(documented: dict[str, str], schema_view: dict[str, str]) -> list[str]:
    problems = [f"missing {name!r}" for name in schema_view if name not in documented]
    problems += [f"{name!r} is not an option" for name in documented if name not in schema_view]
    problems += [
        f"{name!r} default {documented[name]!r}, schema {schema_view[name]!r}"
        for name in documented
        if name in schema_view and documented[name] != schema_view[name]
    ]
    return problems


PLUGIN_TABLES = {
    "gloo_cpu": "plugins/gloo_cpu/README.md",
    "nccl": "plugins/nccl/README.md",
    "cuda_ipc": "plugins/cuda_ipc/README.md",
}


@pytest.mark.parametrize(("backend", "path"), PLUGIN_TABLES.items(), ids=list(PLUGIN_TABLES))
def test_plugin_readme_option_table_matches_the_schema(backend: str, path: str) -> None:
    schema = resolve_backend(backend).options  # type: ignore[attr-defined]
    problems = mismatches(option_table((REPO / path).read_text()), expected(schema))
    assert not problems, f"{path}: {problems}"


def test_the_transport_guide_lists_bucketed_engines_options() -> None:
    text = (REPO / "docs" / "writing-a-transport.md").read_text()
    problems = mismatches(option_table(text), expected(BucketedEngine.options))
    assert not problems, f"docs/writing-a-transport.md: {problems}"


def test_readme_backends_table_lists_each_topology() -> None:
    text = (REPO / "README.md").read_text()
    for backend in PLUGIN_TABLES:
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{backend}` |")]
        documented = {t.strip() for t in row.split("|")[4].split(",")}
        assert documented == set(resolve_backend(backend).options["topology"].choices), row  # type: ignore[attr-defined]


def test_the_nemo_rl_guide_names_only_options_its_engines_have() -> None:
    """docs/nemo-rl.md's table of NeMo RL options (``| `name` | engines | meaning |``, without
    defaults): each option exists on every engine the row names (``all``: the three)."""
    text = (REPO / "docs" / "nemo-rl.md").read_text()
    rows = option_table(text, after="| option | engines | meaning |")
    assert rows, "docs/nemo-rl.md has no option table"
    for name, engines in rows.items():
        backends = list(PLUGIN_TABLES) if engines == "all" else [e.strip() for e in engines.split(",")]
        for backend in backends:
            assert name in resolve_backend(backend).options, f"docs/nemo-rl.md: {backend} has no option {name!r}"  # type: ignore[attr-defined]


def test_the_check_fails_on_a_wrong_default_a_missing_or_an_extra_option() -> None:
    schema = BucketedEngine.options
    table = (
        "| option | default | meaning |\n| --- | --- | --- |\n"
        "| `timeout_s` | `300` | x |\n| `checksum` | `True` | x |\n| `flavour` | `1` | x |\n"
    )
    problems = mismatches(option_table(table), expected(schema))
    assert "'checksum' default 'True', schema 'False'" in problems
    assert "missing 'borrow_received_tensors'" in problems
    assert "'flavour' is not an option" in problems


def test_engine_docstrings_are_generated_from_the_schema() -> None:
    for backend in PLUGIN_TABLES:
        engine_class = resolve_backend(backend)
        doc = engine_class.__doc__ or ""
        assert doc.count("Options (generated from") == 1
        for name, option in engine_class.options.items():  # type: ignore[attr-defined]
            assert f"``{name}`` (" in doc and f"default ``{option.default_text()}``" in doc
    assert "``borrow_received_tensors``" in (BucketedEngine.__doc__ or "")
