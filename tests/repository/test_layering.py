"""The package layout is a contract too: each layer imports only what docs/architecture.md says.

Read from the source (every ``import`` and ``from ... import`` statement, also inside
functions), so a new import that crosses a layer fails here, naming the file and the module.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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


def layer_of(module: str, package: str = "ckpt_core") -> str | None:
    """The layer a module of ``package`` belongs to: its subpackage (``_internal``,
    ``transport``, ``refit``...) or, for a module at the top, that module (``contract``,
    ``chunking``...); ``None`` for the package itself and for other packages."""
    parts = module.split(".")
    return parts[1] if parts[0] == package and len(parts) > 1 else None


def layer_imports(root: Path) -> dict[str, dict[str, list[str]]]:
    """Layer -> layer it imports -> the files (and modules) that make the edge. The package's
    own ``__init__`` (which gathers public names) is no layer: it imports every one of them."""
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative == Path("__init__.py"):
            continue
        source = relative.parts[0].removesuffix(".py")
        for module in imported_modules(path):
            target = layer_of(module, root.name)
            if target is not None and target != source:
                edges.setdefault(source, {}).setdefault(target, []).append(f"{relative}: {module}")
    return edges


def layer_loops(edges: Mapping[str, Mapping[str, list[str]]]) -> list[list[str]]:
    """The strongly connected groups of two or more layers (each a loop), by Tarjan's walk."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(layer: str) -> None:
        index[layer] = low[layer] = len(index)
        stack.append(layer)
        for target in edges.get(layer, {}):
            if target not in index:
                visit(target)
                low[layer] = min(low[layer], low[target])
            elif target in stack:
                low[layer] = min(low[layer], index[target])
        if low[layer] == index[layer]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == layer:
                    break
            if len(group) > 1:
                loops.append(sorted(group))

    for layer in sorted(edges):
        if layer not in index:
            visit(layer)
    return loops


def describe(loops: list[list[str]], edges: Mapping[str, Mapping[str, list[str]]]) -> str:
    lines = []
    for group in loops:
        lines.append(f"layers {group} import each other:")
        for source in group:
            for target, where in sorted(edges.get(source, {}).items()):
                if target in group:
                    lines.append(f"  {source} -> {target}: {', '.join(where)}")
    return "\n".join(lines)


def test_layers_never_loop() -> None:
    """No layer of ckpt_core imports, directly or through others, a layer that imports it: a
    module that ``_internal`` imports imports nothing of ``_internal``, and so on for every
    layer (imports inside functions count: a lazy import is still a dependency)."""
    edges = layer_imports(REPO / "ckpt_core")
    loops = layer_loops(edges)
    assert not loops, describe(loops, edges)


def test_the_loop_check_finds_a_loop(tmp_path: Path) -> None:
    """The check above, over a package with one loop through three layers (and a lazy
    import), names the loop and each edge of it."""
    package = tmp_path / "pkg"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg import low, high\n")
    (package / "low.py").write_text("import torch\n")
    (package / "high.py").write_text("from pkg.inner import work\nfrom pkg import low\n")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "work.py").write_text("from pkg.mid import thing\n")
    (package / "mid.py").write_text("def thing():\n    from pkg.high import y\n")
    edges = layer_imports(package)
    assert layer_loops(edges) == [["high", "inner", "mid"]]
    message = describe(layer_loops(edges), edges)
    assert "mid -> high: mid.py: pkg.high" in message and "high -> low" not in message


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


@pytest.mark.parametrize(
    "module",
    [
        "contract.py",
        "chunking.py",
        "errors.py",
        "registry.py",
        "stats.py",
        "tensors.py",
        "refit/layout/__init__.py",
        "refit/stage.py",
    ],
)
def test_the_contract_imports_no_transport_stack(module: str) -> None:
    heavy = ("ckpt_core.transport.engine", "ckpt_core.transport.torch_distributed", "ckpt_core.orchestration")
    crossing = [m for m in imported_modules(REPO / "ckpt_core" / module) if _within(m, heavy)]
    assert not crossing, f"ckpt_core/{module} imports {crossing}"


def test_the_rss_helper_imports_nothing_of_the_core() -> None:
    """``ckpt_core.rss`` is read by the orchestration layer, the benchmarks and integrations
    alike: it stays a leaf, importing no other module of ckpt-core (so nothing heavy)."""
    imports = [m for m in imported_modules(REPO / "ckpt_core" / "rss.py") if _within(m, ("ckpt_core",))]
    assert not imports, f"ckpt_core/rss.py imports {imports}"


def _overridden_names(folder: Path) -> list[tuple[str, str, str]]:
    """(file, class, name) of every single-underscore method a class in ``folder`` defines."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        name = item.name
                        if name.startswith("_") and not name.startswith("__"):
                            found.append((str(path.relative_to(REPO)), node.name, name))
    return found


@pytest.mark.parametrize("folder", [*PLUGIN_SOURCES, REPO / "ckpt_core" / "testing"], ids=lambda p: p.name)
def test_transports_override_only_the_declared_hooks(folder: Path) -> None:
    """A transport may override the hooks ckpt_core.transport lists (TRANSPORT_HOOKS, and
    DistributedEngine's own); an override of any other name of the engines would reach into
    their internals, which may change under it."""
    from ckpt_core.transport import TRANSPORT_HOOKS, BucketedEngine, DistributedEngine

    allowed = TRANSPORT_HOOKS | DistributedEngine.DISTRIBUTED_HOOKS
    internals = [
        entry
        for entry in _overridden_names(folder)
        if (hasattr(BucketedEngine, entry[2]) or hasattr(DistributedEngine, entry[2])) and entry[2] not in allowed
    ]
    assert not internals, f"these override engine internals, not hooks: {internals}"


def test_the_hooks_are_the_engine_names_a_transport_finds_documented() -> None:
    """Every hook is a method of TransportHooks with a docstring, and BucketedEngine runs them."""
    from ckpt_core.transport import TRANSPORT_HOOKS, BucketedEngine, TransportHooks

    assert {"_connect_policy", "_connect_rollout", "_prepare_transport", "_release_transport"} <= TRANSPORT_HOOKS
    assert issubclass(BucketedEngine, TransportHooks)
    undocumented = [name for name in TRANSPORT_HOOKS if not (getattr(TransportHooks, name).__doc__ or "").strip()]
    assert not undocumented, undocumented


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


INTEGRATION_SOURCES = [REPO / "integrations" / "vllm" / "ckpt_vllm", REPO / "integrations" / "verl" / "ckpt_verl"]
# What an integration may import from the core: the consumer's contract, the registry,
# errors, option checks, statistics, host memory release, resident memory as reports measure
# it (rss), destination layouts, FP8 formats and the rollout's quantization (quantize-on-send),
# and the orchestration layer; never the internals or a transport's stack.
INTEGRATION_API = (
    "ckpt_core.contract",
    "ckpt_core.registry",
    "ckpt_core.errors",
    "ckpt_core.options",
    "ckpt_core.stats",
    "ckpt_core.host_pool",
    "ckpt_core.rss",
    "ckpt_core.refit.layout",
    "ckpt_core.refit.quantize.fp8",
    "ckpt_core.refit.quantize",
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
