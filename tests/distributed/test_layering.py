"""The layering of ``gradfleet.distributed`` (its package docstring), checked from the imports.

Every module belongs to its folder's layer, which the folder declares in its ``__init__``
docstring; it may import modules of its own layer or lower ones only.  The algorithm layer
imports neither ``torch.distributed`` nor the transport, and SyncReplicas' folders never reach
across.  And no module
swallows an exception without a log line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import gradfleet.distributed

ROOT = Path(gradfleet.distributed.__file__).parent
PACKAGE = "gradfleet.distributed"

#: the layers, lowest first; each folder names its own in its ``__init__`` docstring
LAYER_NAMES = ("algorithms", "communication", "hosting", "wrappers", "jobs")
ALGORITHMS = 1
_DECLARED = re.compile(r"^Layer: (\w+)\.$", re.M)


def folder_layer(folder: Path) -> int:
    """The layer a folder declares (``Layer: NAME.`` in its ``__init__`` docstring)."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    found = _DECLARED.findall(doc)
    assert len(found) == 1 and found[0] in LAYER_NAMES, (
        f"{folder}: its __init__ docstring must say 'Layer: NAME.' once, NAME in {LAYER_NAMES}"
    )
    return LAYER_NAMES.index(found[0]) + 1


def layers() -> dict[str, int]:
    """Every module's layer: its folder's."""
    return {name: folder_layer(path.parent) for name, path in modules().items()}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = f"{PACKAGE}.{name}" if path.name == "__init__.py" else f"{PACKAGE}.{name}"
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rstrip(".").split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def internal(names: set[str]) -> set[str]:
    """The modules of this package among ``names`` (a name that is an attribute of a module,
    e.g. ``...sync.shards.Shard``, resolves to its module)."""
    known = modules()
    out = set()
    for full in names:
        if not full.startswith(PACKAGE):
            continue
        rest = full[len(PACKAGE) + 1 :]
        while rest not in known and "." in rest:
            rest = rest.rsplit(".", 1)[0]
        out.add(rest if rest in known else "")
    return out


def test_every_folder_declares_its_layer():
    for init in ROOT.rglob("__init__.py"):
        folder_layer(init.parent)


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_imports_a_higher_layer(name):
    path, layer = modules()[name], layers()
    for other in internal(imported(name, path)) - {name}:
        assert layer[other] <= layer[name], (
            f"{name} (layer {layer[name]}) imports {other} (layer {layer[other]})"
        )


#: folders of SyncReplicas that must not import each other (the shared pieces sit in
#: ``sync.common``; ``sync.server_exchange`` joins the three)
APART = {"sync.worker": ("sync.server",), "sync.layout": ("sync.server", "sync.worker"),
         "sync.server": ("sync.worker",)}  # fmt: skip


@pytest.mark.parametrize("folder", sorted(APART))
def test_sync_folders_never_reach_across(folder):
    for name, path in modules().items():
        if name != folder and not name.startswith(folder + "."):
            continue
        for other in internal(imported(name, path)):
            for apart in APART[folder]:
                assert other != apart and not other.startswith(apart + "."), (
                    f"{name} imports {other}: {folder} never reaches into {apart}"
                )


@pytest.mark.parametrize("name", sorted(n for n, layer in layers().items() if layer == ALGORITHMS))
def test_algorithms_do_no_io(name):
    names = imported(name, modules()[name])
    assert not {n for n in names if n.startswith("torch.distributed")}, name
    assert not {n for n in internal(names) if n.startswith("transport")}, name
    forbidden = {"socket", "threading", "subprocess", "os"}
    assert not forbidden & {n.split(".")[0] for n in names}, name


def _swallows(handler: ast.ExceptHandler) -> bool:
    """A broad handler that neither raises nor hands the exception on (stores it for the
    caller's thread to raise, or reports it into the worker's error latch, which logs it)."""
    broad = handler.type is None or (
        isinstance(handler.type, ast.Name) and handler.type.id in ("Exception", "BaseException")
    )
    raises = any(isinstance(n, ast.Raise) for n in ast.walk(handler))
    stored = handler.name is not None and any(
        isinstance(n, ast.Assign)
        and any(
            isinstance(v, ast.Name) and v.id == handler.name
            for v in ([n.value] if not isinstance(n.value, ast.Tuple) else n.value.elts)
        )
        for n in ast.walk(handler)
    )
    latched = handler.name is not None and any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "report"
        and any(isinstance(a, ast.Name) and a.id == handler.name for a in n.args)
        for n in ast.walk(handler)
    )
    return broad and not raises and not stored and not latched


def _logs(handler: ast.ExceptHandler) -> bool:
    return any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "log"
        for n in ast.walk(handler)
    )


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_exception_swallowed_without_a_log_line(name):
    tree = ast.parse(modules()[name].read_text())
    silent = [
        h.lineno
        for h in ast.walk(tree)
        if isinstance(h, ast.ExceptHandler) and _swallows(h) and not _logs(h)
    ]
    assert not silent, f"{name}: broad except without a log line at lines {silent}"


@pytest.mark.parametrize("name", sorted(modules()))
def test_loggers_are_named_for_their_module(name):
    text = modules()[name].read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "getLogger":
            assert [ast.unparse(a) for a in node.args] == ["__name__"], name
