"""A static scan for object serialization (pickle and friends) in production code.

A control socket or store that unpickles what it receives runs whatever its sender wants.
:func:`scan` parses every module of the given trees and reports each import of a module that
serializes Python objects, and each call that does so (``torch.save``/``torch.load``,
``send_pyobj``/``recv_pyobj``, torch.distributed's ``*_object`` collectives, ``yaml.load``,
``numpy.load``, ``eval``/``exec``). Aliases (``import torch as t``, ``from torch import
load``) are resolved.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

FORBIDDEN_MODULES = {
    "pickle": "unpickling runs arbitrary code",
    "_pickle": "unpickling runs arbitrary code",
    "cPickle": "unpickling runs arbitrary code",
    "cloudpickle": "unpickling runs arbitrary code",
    "dill": "unpickling runs arbitrary code",
    "jsonpickle": "decoding runs arbitrary code",
    "marshal": "marshal data can crash or subvert the interpreter",
    "shelve": "shelve pickles its values",
    "copyreg": "only useful to customize pickling",
    "xmlrpc": "object-marshalling RPC",
    "multiprocessing": "Connection.send/recv, Queue and managers pickle every object",
}
ALLOWED_SUBMODULES = {"multiprocessing.shared_memory": "raw bytes, no objects"}

FORBIDDEN_CALLS = {
    "torch.save": "pickles its argument",
    "torch.load": "unpickles (even with weights_only, a parser of untrusted input)",
    "numpy.load": "unpickles object arrays when allow_pickle is set",
    "yaml.load": "can build arbitrary objects",
    "yaml.unsafe_load": "builds arbitrary objects",
    "eval": "runs text as code",
    "exec": "runs text as code",
}
FORBIDDEN_METHODS = {
    "send_pyobj": "zmq: pickles",
    "recv_pyobj": "zmq: unpickles",
    "broadcast_object_list": "torch.distributed: pickles",
    "all_gather_object": "torch.distributed: pickles",
    "gather_object": "torch.distributed: pickles",
    "scatter_object_list": "torch.distributed: pickles",
    "send_object_list": "torch.distributed: pickles",
    "recv_object_list": "torch.distributed: pickles",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what} ({self.why})"


def _forbidden_module(name: str) -> str | None:
    if any(name == ok or name.startswith(ok + ".") for ok in ALLOWED_SUBMODULES):
        return None
    root = name.split(".")[0]
    return FORBIDDEN_MODULES.get(root)


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}  # local name -> dotted origin
        self.findings: list[Finding] = []

    def _flag(self, node: ast.AST, what: str, why: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), what, why))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.aliases[alias.asname or alias.name.split(".")[0]] = (
                alias.name if alias.asname else alias.name.split(".")[0]
            )
            why = _forbidden_module(alias.name)
            if why:
                self._flag(node, f"import {alias.name}", why)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            origin = f"{module}.{alias.name}" if module else alias.name
            self.aliases[alias.asname or alias.name] = origin
            why = _forbidden_module(origin) if node.level == 0 else None
            if why:
                self._flag(node, f"from {module} import {alias.name}", why)

    def _dotted(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self._dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def visit_Call(self, node: ast.Call) -> None:
        name = self._dotted(node.func)
        if name is not None:
            name = name.replace("np.", "numpy.", 1) if name.startswith("np.") else name
            if name in FORBIDDEN_CALLS:
                self._flag(node, f"call {name}()", FORBIDDEN_CALLS[name])
        if isinstance(node.func, ast.Attribute) and node.func.attr in FORBIDDEN_METHODS:
            self._flag(node, f"call .{node.func.attr}()", FORBIDDEN_METHODS[node.func.attr])
        self.generic_visit(node)


def scan_source(source: str, path: str) -> list[Finding]:
    scanner = _Scanner(path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.findings


def production_modules(repo: Path) -> list[Path]:
    """Every module of ``ckpt_core`` and of each plugin's import package."""
    files = sorted((repo / "ckpt_core").rglob("*.py"))
    for package in sorted((repo / "plugins").glob("*/ckpt_*")):
        if package.is_dir() and not package.name.endswith(".egg-info"):
            files.extend(sorted(package.rglob("*.py")))
    return files


def scan(repo: Path) -> list[Finding]:
    findings = []
    for path in production_modules(repo):
        findings.extend(scan_source(path.read_text(), str(path.relative_to(repo))))
    return findings
