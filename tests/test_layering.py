"""The package layout is a contract too: each layer imports only what docs/architecture.md says.

Read from the source (every ``import`` and ``from ... import`` statement, also inside
functions), so a new import that crosses a layer fails here, naming the file and the module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = [
    REPO / "plugins" / "gloo_cpu" / "ckpt_gloo_cpu",
    REPO / "plugins" / "nccl" / "ckpt_nccl",
    REPO / "plugins" / "cuda_ipc" / "ckpt_cuda_ipc",
    REPO / "plugins" / "_template" / "ckpt_my_transport",
    REPO / "examples" / "tcp_transport" / "ckpt_tcp_example",
]
# What a transport may import from the core: its public package, the contract and the errors.
TRANSPORT_API = ("ckpt_core.transport", "ckpt_core.contract", "ckpt_core.errors")


def imported_modules(path: Path) -> list[str]:
    """Every absolute module name ``path`` imports (``from x import y`` counts as ``x``)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _core_imports(folder: Path) -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(REPO)), module)
        for path in sorted(folder.rglob("*.py"))
        for module in imported_modules(path)
        if _within(module, ("ckpt_core",))
    ]


@pytest.mark.parametrize("folder", PLUGIN_SOURCES, ids=lambda p: p.name)
def test_transports_import_only_the_transport_api(folder: Path) -> None:
    crossing = [(f, m) for f, m in _core_imports(folder) if not _within(m, TRANSPORT_API)]
    assert not crossing, f"import from ckpt_core.transport (or the contract, or errors) instead: {crossing}"


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        (
            "_internal",
            (
                "ckpt_core.transport",
                "ckpt_core.orchestration",
                "ckpt_core.bench",
                "ckpt_core.testing",
                "ckpt_core.automodel",
            ),
        ),
        ("transport", ("ckpt_core.orchestration", "ckpt_core.bench", "ckpt_core.testing", "ckpt_core.automodel")),
        ("orchestration", ("ckpt_core.testing", "ckpt_core.bench")),
    ],
)
def test_lower_layers_do_not_import_higher_ones(layer: str, forbidden: tuple[str, ...]) -> None:
    crossing = [(f, m) for f, m in _core_imports(REPO / "ckpt_core" / layer) if _within(m, forbidden)]
    assert not crossing, f"ckpt_core.{layer} must not import {forbidden}: {crossing}"


@pytest.mark.parametrize("module", ["contract.py", "chunking.py", "errors.py", "registry.py", "stats.py", "layout.py"])
def test_the_contract_imports_no_transport_stack(module: str) -> None:
    heavy = ("ckpt_core.transport.engine", "ckpt_core.transport.torch_distributed", "ckpt_core.orchestration")
    crossing = [m for m in imported_modules(REPO / "ckpt_core" / module) if _within(m, heavy)]
    assert not crossing, f"ckpt_core/{module} imports {crossing}"


def test_nothing_in_the_library_imports_the_seed_module() -> None:
    """``ckpt_core.base`` gathers the seed's names for code written against NeMo RL; the library
    itself imports them from where they live, so base.py stays a leaf with no cycle through it."""
    users = [
        (f, m)
        for folder in (REPO / "ckpt_core", *PLUGIN_SOURCES)
        for f, m in _core_imports(folder)
        if m == "ckpt_core.base" and not f.endswith("ckpt_core/__init__.py")
    ]
    assert not users, users


INTEGRATION_SOURCES = [REPO / "integrations" / "vllm" / "ckpt_vllm"]
# What an integration may import from the core: the consumer's contract, the registry,
# errors, option checks, statistics, host memory release, destination layouts, FP8 formats
# and the rollout's quantization (quantize-on-send), and the orchestration layer; never the
# internals or a transport's stack.
INTEGRATION_API = (
    "ckpt_core.contract",
    "ckpt_core.registry",
    "ckpt_core.errors",
    "ckpt_core.options",
    "ckpt_core.stats",
    "ckpt_core.host_pool",
    "ckpt_core.layout",
    "ckpt_core.fp8",
    "ckpt_core.quantize",
    "ckpt_core.orchestration",
)


@pytest.mark.parametrize("folder", INTEGRATION_SOURCES, ids=lambda p: p.parent.name)
def test_integrations_use_only_the_consumer_side_of_the_core(folder: Path) -> None:
    crossing = [(f, m) for f, m in _core_imports(folder) if not _within(m, INTEGRATION_API)]
    assert not crossing, f"integrations import the consumer API, not internals or transports: {crossing}"
    transports = [
        (str(p.relative_to(REPO)), m)
        for p in sorted(folder.rglob("*.py"))
        for m in imported_modules(p)
        if _within(m, ("ckpt_gloo_cpu", "ckpt_nccl", "ckpt_cuda_ipc"))
    ]
    assert not transports, f"an integration reaches transports only by name, through the registry: {transports}"


def test_the_core_never_imports_an_integration() -> None:
    users = [
        (str(p.relative_to(REPO)), m)
        for p in sorted((REPO / "ckpt_core").rglob("*.py"))
        for m in imported_modules(p)
        if _within(m, ("ckpt_vllm",))
    ]
    assert not users, users
