"""The import layering of eagle_jax, read from the source with ``ast`` (nothing is imported).

One test per rule. Every import counts, including those inside functions and under
``TYPE_CHECKING``: a lazy import is still a dependency. The layers, lowest first:

    config, checkpoint, tokenizer, bpe, sampling; kernels; models   (the model side)
    testutil                                                        (test helpers)
    train, engine, server, eval, compare, bench, cli                (the higher layers)

and the engine's private names stay inside ``eagle_jax/engine`` (tests and scripts too).
"""

from __future__ import annotations

import ast
import itertools
import pathlib
from typing import NamedTuple

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "eagle_jax"
HIGHER_LAYERS = tuple(f"eagle_jax.{p}" for p in ("train", "engine", "server", "eval", "compare",
                                                  "bench", "cli"))


class Import(NamedTuple):
    path: str  # relative to the repository root
    line: int
    name: str  # the imported module, or module.name for ``from module import name``


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees(package: str = "eagle_jax"):
    """(path, module name, ast) of every module of ``package`` (a folder of the
    repository: ``eagle_jax``, ``tests``, ``scripts``)."""
    root = PACKAGE.parent.joinpath(*package.split("."))
    for path in sorted(root.rglob("*.py")):
        yield path, _module_name(path), ast.parse(path.read_text(), str(path))


def _imports(package: str) -> list[Import]:
    out = []
    for path, module, tree in _trees(package):
        rel = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [Import(rel, node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    pkg = module.split(".")
                    pkg = pkg[:len(pkg) - node.level + (path.name == "__init__.py")]
                    base = ".".join(pkg + ([base] if base else []))
                out += [Import(rel, node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{i.path}:{i.line} imports {i.name}" for i in _imports(package)
            if _within(i.name, forbidden)]


def test_testutil_depends_on_nothing_above_models():
    assert _violations("eagle_jax.testutil", HIGHER_LAYERS) == []


def test_models_and_kernels_depend_on_nothing_above_them():
    for package in ("eagle_jax.models", "eagle_jax.kernels"):
        assert _violations(package, HIGHER_LAYERS) == []


def test_kernels_are_imported_plainly():
    """No ``importlib.import_module("eagle_jax.kernels...")``: a kernel function is imported
    from its module. (The comparison tool's walk over every kernel module names none.)"""
    found = []
    for path, _, tree in _trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                    and node.args[0].value.startswith("eagle_jax.kernels")
                    and (getattr(node.func, "attr", None) == "import_module"
                         or getattr(node.func, "id", None) == "import_module")):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == []


def test_kernels_package_hides_no_submodule():
    """``eagle_jax/kernels/__init__.py`` binds no name of a kernel module (a function
    ``gathered_lm_head`` would hide the module ``gathered_lm_head``)."""
    init = PACKAGE / "kernels" / "__init__.py"
    submodules = {p.stem for p in init.parent.glob("*.py")} - {"__init__"}
    bound = set()
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    assert bound & submodules == set()


def _engine_private_names() -> set[str]:
    """Single-underscore names the engine package defines: functions, classes, methods,
    module globals and ``self._x`` attributes."""
    names = set()
    for _, _, tree in _trees("eagle_jax.engine"):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_nothing_outside_the_engine_reaches_a_private_engine_name():
    """Tools, tests and benchmarks watch or swap parts of the engine through its public
    seams (``compile_fn``, ``add_step_listener``, ``step_function``, the parts' public
    members), never through its private names: no import of one, no attribute access to
    one on another object, no override of one."""
    private = _engine_private_names()
    found = []
    for path, module, tree in itertools.chain(_trees(), _trees("tests"), _trees("scripts")):
        if _within(module, ("eagle_jax.engine",)):
            continue
        rel = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "eagle_jax.engine")):
                found += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name in private]
            elif (isinstance(node, ast.Attribute) and node.attr in private
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.append(f"{rel}:{node.lineno} reads .{node.attr}")
            elif isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith("Engine")
                    for b in node.bases):
                found += [f"{rel}:{f.lineno} overrides {f.name}" for f in node.body
                          if isinstance(f, ast.FunctionDef) and f.name in private]
    assert found == []


def test_checkpoint_and_parallel_do_not_import_each_other():
    """The checkpoint loader and tensor parallelism share the parameter walk and ``put``
    through ``eagle_jax/params.py``, a leaf: neither imports the other, not even lazily,
    and the leaf imports neither."""
    pair = ("eagle_jax.checkpoint", "eagle_jax.parallel")
    files = {"eagle_jax/checkpoint.py", "eagle_jax/parallel.py", "eagle_jax/params.py"}
    found = [f"{i.path}:{i.line} imports {i.name}" for i in _imports("eagle_jax")
             if i.path in files and _within(i.name, pair)]
    assert found == []
