"""The walls of docs/architecture.md, as code: every import of every module in vcga/, plugins/,
formats/ and conformance/ is read (AST: top-level, inside functions and classes, under
TYPE_CHECKING, and ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name)
and held to them:

- the core never imports a plugin module (plugins/, formats/, or a module the plugin manager loads
  as a built-in plugin, :data:`vcga.plugin_manager.BUILTIN_PLUGINS`);
- a plugin -- every backend plugin, every format, every conformance module -- imports from VCGA
  only the public core API (:data:`vcga.contract.PUBLIC_API`) and its own package, never another
  plugin;
- formats never import torch, except the torch format;
- only the CLI prints (a ``__main__`` block is a command line too).

``vcga --help`` importing neither torch nor a plugin is tested in tests/test_cli.py.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vcga.contract import PUBLIC_API
from vcga.plugin_manager import BUILTIN_PLUGINS

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as (pyproject.toml's package-dir)
TREES = {"vcga": "vcga", "plugins": "vcga.plugins", "formats": "vcga.formats", "conformance": "vcga.conformance"}
PLUGIN_TREES = ("vcga.plugins", "vcga.formats", "vcga.conformance")
#: the one format that converts torch checkpoints, and so may import torch
TORCH_FORMATS = ("vcga.formats.torch_pt",)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = [TREES[rel.parts[0]], *rel.parts[1:]]
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for tree in TREES for p in sorted((ROOT / tree).rglob("*.py"))}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@dataclass(frozen=True)
class Import:
    module: str  #: the module imported (``from a import b`` names a.b when that is a module, else a)
    line: int
    how: str  #: "import", "importlib" or "print"


def _is_main_block(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in t.comparators))


def imports_of(name: str, source: str) -> list[Import]:
    """Every import in ``source`` (module ``name``), wherever it sits, plus its print calls."""
    is_pkg = MODULES.get(name, Path()).name == "__init__.py"
    out: list[Import] = []

    def visit(node: ast.AST, in_main: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend(Import(a.name, node.lineno, "import") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append(Import(sub if sub in MODULES else mod, node.lineno, "import"))
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if (fname in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                out.append(Import(node.args[0].value, node.lineno, "importlib"))
            if fname == "print" and isinstance(f, ast.Name) and not in_main:
                out.append(Import("print", node.lineno, "print"))
        elif isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr") and not in_main and \
                isinstance(node.value, ast.Name) and node.value.id == "sys":
            out.append(Import(f"sys.{node.attr}", node.lineno, "print"))
        for child in ast.iter_child_nodes(node):
            visit(child, in_main or _is_main_block(node))

    visit(ast.parse(source), False)
    return out


def _own_package(name: str) -> str:
    """The package a plugin module may import freely: its own format package (formats/mindrecord/),
    the conformance package, or just itself (a single-module backend plugin or format)."""
    if _under(name, "vcga.conformance"):
        return "vcga.conformance"
    parts = name.split(".")
    if len(parts) < 3:  # vcga.plugins / vcga.formats themselves: no plugin of their own
        return name + ".__init__"
    return ".".join(parts[:3])  # vcga.plugins.gloo, vcga.formats.vbin (+ its modules)


def violations(name: str, source: str) -> list[str]:
    """What module ``name`` (with ``source``) does against the walls; empty when it keeps them."""
    plugin = any(_under(name, t) for t in PLUGIN_TREES)
    cli = _under(name, "vcga.cli")
    bad = []
    for imp in imports_of(name, source):
        where = f"{name}:{imp.line}"
        m = imp.module
        if imp.how == "print":
            if not cli:
                bad.append(f"{where} writes to the terminal ({m}); only the CLI prints, the library logs and raises")
            continue
        if not plugin:
            if any(_under(m, t) for t in ("vcga.plugins", "vcga.formats")) or m in BUILTIN_PLUGINS:
                bad.append(f"{where}: the core imports plugin module {m}")
            continue
        if _under(m, "vcga") and not _under(m, _own_package(name)) and m not in PUBLIC_API:
            what = "another plugin" if any(_under(m, t) for t in PLUGIN_TREES) else "a core internal"
            bad.append(f"{where}: a plugin imports {what}, {m} (allowed: vcga.contract.PUBLIC_API)")
        if (_under(name, "vcga.formats") and name not in TORCH_FORMATS and _under(m.split(".")[0], "torch")):
            bad.append(f"{where}: a format imports {m}; only the torch format may import torch")
    return bad


def test_every_module_keeps_the_walls():
    assert len(MODULES) > 60 and "vcga.plugins.sim" in MODULES and "vcga.formats.mindrecord.reader" in MODULES
    bad = [v for name, path in MODULES.items() for v in violations(name, path.read_text())]
    assert not bad, "\n".join(bad)


def test_the_public_api_and_the_builtin_plugins_exist():
    """A name in either list that is no module would keep the walls test quiet about nothing."""
    assert set(PUBLIC_API) <= set(MODULES), set(PUBLIC_API) - set(MODULES)
    assert set(BUILTIN_PLUGINS) <= set(MODULES), set(BUILTIN_PLUGINS) - set(MODULES)
    assert not [m for m in PUBLIC_API if any(_under(m, t) for t in PLUGIN_TREES)]
    # all five backend plugins are held to the walls
    assert {"vcga.plugins.gloo", "vcga.plugins.sim", "vcga.plugins.nccl", "vcga.plugins.hccl",
            "vcga.plugins.mlu"} <= set(MODULES) & set(BUILTIN_PLUGINS)


def top_level_internals(modules: list[str], public: tuple[str, ...]) -> list[str]:
    """Modules directly under ``vcga/`` that are neither public API nor private (``_name``)."""
    return [m for m in modules if m not in public and not m.rsplit(".", 1)[1].startswith("_")]


def test_the_top_level_of_vcga_is_the_public_api():
    """``vcga/*.py`` is what plugins and users import; internals live in subpackages named for what they do."""
    top = [n for n, p in MODULES.items() if p.parent == ROOT / "vcga" and p.name != "__init__.py"]
    assert len(top) > 10  # the listing is what we think it is
    assert top_level_internals(top, PUBLIC_API) == []
    # and the rule bites: an internal module at the top is named
    assert top_level_internals([*top, "vcga.hostbridge"], PUBLIC_API) == ["vcga.hostbridge"]


# The checker itself, on modules that break each wall (and one that keeps them).
@pytest.mark.parametrize(("name", "source", "expected"), [
    ("vcga.plugins.nccl", "def f():\n    from vcga.pg.dispatch import Dispatcher\n", "a core internal, vcga.pg.dispatch"),
    ("vcga.plugins.nccl", "from vcga.plugins import gloo\n", "another plugin, vcga.plugins.gloo"),
    ("vcga.plugins.mlu", "from . import gloo\n", "another plugin, vcga.plugins.gloo"),
    ("vcga.plugins.sim.group", "from .. import gloo\n", "another plugin, vcga.plugins.gloo"),
    ("vcga.plugins", "from .gloo import GlooBackend\n", "another plugin, vcga.plugins.gloo"),
    ("vcga.plugins.mlu", "import importlib\nm = importlib.import_module('vcga.bridge')\n", "a core internal, vcga.bridge"),
    ("vcga.formats.hdf5", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n",
     "only the torch format may import torch"),
    ("vcga.formats.vbin.reader", "from vcga.formats.mindrecord import _format\n", "another plugin"),
    ("vcga.conformance.numerics", "from vcga.pg.dispatch import Steps\n", "a core internal, vcga.pg.dispatch"),
    ("vcga.pg.dispatch", "def f():\n    import vcga.plugins.sim\n", "the core imports plugin module vcga.plugins.sim"),
    ("vcga.plugin_manager", "__import__('vcga.conformance.checks')\n", "the core imports plugin module"),
    ("vcga.convert", "print('done')\n", "only the CLI prints"),
    ("vcga.formats.hdf5", "import sys\nsys.stderr.write('x')\n", "only the CLI prints"),
])
def test_the_checker_catches_each_kind_of_breach(name, source, expected):
    bad = violations(name, source)
    assert len(bad) == 1 and expected in bad[0], bad


def test_the_checker_lets_allowed_imports_pass():
    ok = {
        "vcga.plugins.sim": "from vcga.pypg import PyWork\nfrom vcga import dtypes\nimport vcga.contract\n",
        "vcga.formats.vbin.reader": "from ._format import MAGIC\nfrom vcga.formatkit import ReaderContext\n",
        "vcga.formats.torch_pt": "import torch\n",
        "vcga.conformance.numerics": "from .base import Check\nfrom vcga.plugin_manager import get_plugin_manager\n",
        "vcga.cli.info": "print('hello')\n",
        "vcga.plugins.gloo": "if __name__ == '__main__':\n    print('usage')\n",
        "vcga.process_group": "from vcga.pg.dispatch import Dispatcher\nfrom vcga.conformance import suite\n",
    }
    for name, source in ok.items():
        assert violations(name, source) == [], (name, violations(name, source))


def test_formats_do_not_import_torch_at_run_time():
    """The static check sees direct imports; this sees what importing each format really loads."""
    fmts = [m for m in MODULES if _under(m, "vcga.formats") and m not in TORCH_FORMATS]
    code = ("import importlib, sys\n"
            f"for m in {fmts!r}:\n    importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


#: The size rule: no module of the four folders is over ~600 lines; split by responsibility
#: before one reaches this (a module grows past it unnoticed one feature at a time).
MAX_MODULE_LINES = 650


def test_no_module_of_the_four_folders_outgrows_the_size_rule():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for folder in ("vcga", "plugins", "formats", "conformance") for p in (ROOT / folder).rglob("*.py")}
    assert len(sizes) > 50  # the walk found the modules
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {over}"


def test_every_package_of_the_four_folders_is_in_the_wheel():
    """pyproject.toml lists the packages a wheel installs (the folders map to installed names through
    package-dir, so setuptools cannot discover them): a package left off that list works in the
    editable checkout, where the suite runs, and is missing for every user who pip-installs."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml takes Python 3.11's tomllib")
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert setuptools["package-dir"] == {pkg: folder for folder, pkg in TREES.items()}
    packages = {_module_name(p) for tree in TREES for p in (ROOT / tree).rglob("__init__.py")}
    assert "vcga.pg" in packages  # the walk found the packages
    missing = sorted(packages - set(setuptools["packages"]))
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"
