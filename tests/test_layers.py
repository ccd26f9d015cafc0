"""Library first, CLI last: imports only point down the layers, and domain code never imports typer or rich.

Layers, low → high (README "How it is built"); a module may import its own layer and the ones below:

    zoomr.configs, zoomr.errors, zoomr.grading → zoomr.kvstore → zoomr.backends
    → zoomr.options, zoomr.factory, zoomr.prompts, zoomr.loading, zoomr.solving → zoomr.rescue
    → zoomr.evaluation, zoomr.finetune → zoomr.cli

Two checks over every module of the installed package: what importing it really loads (each module in a
fresh interpreter), and every import statement in its source, the ones inside functions included (a lazy
import of a higher layer loads nothing at import time but is the same dependency).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest

from conftest import ENV, ROOT

LAYERS = [
    ("zoomr.configs", "zoomr.errors", "zoomr.grading"),
    ("zoomr.kvstore",),
    ("zoomr.backends",),
    ("zoomr.options", "zoomr.factory", "zoomr.prompts", "zoomr.loading", "zoomr.solving"),
    ("zoomr.rescue",),
    ("zoomr.evaluation", "zoomr.finetune"),
    ("zoomr.cli", "zoomr.__main__"),
]
CLI = len(LAYERS) - 1
TERMINAL_LIBRARIES = ("typer", "rich")


def layer_of(module: str) -> int | None:
    """The layer index of a zoomr module; None for the ``zoomr`` package itself (imports nothing eagerly)."""
    if module == "zoomr":
        return None
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS here and to README's layer list")


def all_modules() -> list[str]:
    """Every module of the packages pyproject installs (found by spec: no module is imported here)."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    names = set(packages)
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        names.update(f"{pkg}.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)
                     if not m.ispkg)
    return sorted(names)


MODULES = all_modules()
# zoomr.__main__ runs the CLI when imported: its import statements are checked, not its import
IMPORTABLE = [m for m in MODULES if m != "zoomr.__main__"]

# Forks a child per module from one fresh interpreter: each child starts with no zoomr module loaded, as a
# new interpreter would, without paying the interpreter and torch start-up once per module. torch and numpy
# (not zoomr, not a terminal library) are loaded before forking for that reason.
PROBE = r"""
import importlib, json, os, sys
import numpy, torch
assert not any(m.split(".")[0] in ("zoomr", "typer", "rich") for m in sys.modules), "probe parent not clean"
found = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            out = sorted(m for m in sys.modules if m.split(".")[0] in ("zoomr", "typer", "rich"))
        except BaseException as e:
            out = {"error": repr(e)}
        with os.fdopen(w, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        found[name] = json.load(f)
    os.waitpid(pid, 0)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str]]:
    """module → the zoomr, typer and rich modules that importing it (alone, in a fresh interpreter) loads."""
    r = subprocess.run([sys.executable, "-c", PROBE, *IMPORTABLE], capture_output=True, text=True, env=ENV,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_layer_has_modules():
    """The checks below cover the whole package (a wrong package list would make them pass vacuously)."""
    by_layer = {layer_of(m) for m in MODULES}
    assert by_layer >= set(range(len(LAYERS))) and len(MODULES) > 60


def test_importing_a_module_loads_no_higher_layer(loaded):
    bad = {}
    for name in IMPORTABLE:
        mods = loaded[name]
        assert not isinstance(mods, dict), f"import {name} failed: {mods['error']}"
        assert name in mods
        top = layer_of(name)
        higher = [m for m in mods if m.startswith("zoomr.") and (layer_of(m) or 0) > (top or 0)]
        terminal = sorted({m.split(".")[0] for m in mods} & set(TERMINAL_LIBRARIES)) if top != CLI else []
        eager = [m for m in mods if m.startswith("zoomr.")] if top is None else []  # the package is lazy
        if higher or terminal or eager:
            bad[name] = higher + terminal + eager
    assert not bad, "imports pointing up the layers (module: what it loaded):\n" + "\n".join(
        f"  {k}: {', '.join(v)}" for k, v in bad.items())


def imported_names(module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in ``module``'s source, nested ones included.

    ``from zoomr import solving`` counts as ``zoomr.solving``, ``from zoomr import load`` as the module that
    defines ``load`` (the package's lazy exports).
    """
    import zoomr

    spec = importlib.util.find_spec(module)
    tree = ast.parse(open(spec.origin, encoding="utf-8").read(), spec.origin)
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:
                    out.append((node.lineno, sub))
                elif base == "zoomr" and a.name in zoomr._EXPORTS:
                    out.append((node.lineno, zoomr._EXPORTS[a.name]))
                else:
                    out.append((node.lineno, base))
    return out


def test_no_import_statement_points_up():
    bad = []
    for name in MODULES:
        top = layer_of(name)
        for line, target in imported_names(name):
            root = target.split(".")[0]
            if root in TERMINAL_LIBRARIES and top != CLI:
                bad.append(f"{name}:{line} imports {target} (terminal output belongs to zoomr.cli)")
            if root != "zoomr" or target == "zoomr":
                continue
            if (layer_of(target) or 0) > (top or 0):
                bad.append(f"{name}:{line} imports {target}, a higher layer")
    assert not bad, "\n".join(bad)
