"""The layering of ``gradfleet.distributed`` (its package docstring), checked from the imports.

Every module belongs to one layer; it may import modules of its own layer or lower ones only.
The algorithm layer imports neither ``torch.distributed`` nor the transport.  And no module
swallows an exception without a log line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gradfleet.distributed

ROOT = Path(gradfleet.distributed.__file__).parent
PACKAGE = "gradfleet.distributed"

ALGORITHMS, COMMUNICATION, HOSTING, WRAPPERS, JOBS = 1, 2, 3, 4, 5
LAYERS = {
    "apply": ALGORITHMS,
    "flat": ALGORITHMS,
    "membership": ALGORITHMS,
    "moving_average": ALGORITHMS,
    "replies": ALGORITHMS,
    "sync.server.aggregator": ALGORITHMS,
    "sync.server.shards": ALGORITHMS,
    "sync.layout.pieces": ALGORITHMS,
    "sync.server.read_ahead": ALGORITHMS,
    "sync.server.chief": ALGORITHMS,
    "sync.server.token_line": ALGORITHMS,
    "sync.server.token_requests": ALGORITHMS,
    "sync.server.replicas_policy": ALGORITHMS,
    "sync.server.replica_choice": ALGORITHMS,
    "sync.outcome": ALGORITHMS,
    "easgd.centre_server": ALGORITHMS,
    "transport": COMMUNICATION,
    "transport.wire": COMMUNICATION,
    "transport.pairs": COMMUNICATION,
    "transport.peer": COMMUNICATION,
    "transport.mailbox": COMMUNICATION,
    "transport.client": COMMUNICATION,
    "all_reduce": COMMUNICATION,
    "collectives": COMMUNICATION,
    "process_group": COMMUNICATION,
    "hosting": HOSTING,
    "sync.server.servers": HOSTING,
    "sync.worker.shard_clients": HOSTING,
    "sync.worker.plain_links": HOSTING,
    "sync.worker.ahead_links": HOSTING,
    "sync.worker.pacing": HOSTING,
    "sync.worker.pending_step": HOSTING,
    "sync.worker.answer_taker": HOSTING,
    "sync.worker.streaming": HOSTING,
    "sync.worker.early_pushes": HOSTING,
    "sync.worker.error_latch": HOSTING,
    "dedicated": HOSTING,
    "closing": HOSTING,
    "sync.layout.shard_layout": HOSTING,
    "wrapper": WRAPPERS,
    "sync.arguments": WRAPPERS,
    "sync.worker.allreduce": WRAPPERS,
    "sync.optimizer": WRAPPERS,
    "sync.worker.overlap": WRAPPERS,
    "sync.worker.server_exchange": WRAPPERS,
    "sync": WRAPPERS,
    "sync.server": ALGORITHMS,  # the folders' __init__ modules: docstrings only
    "sync.worker": ALGORITHMS,
    "sync.layout": ALGORITHMS,
    "easgd.centre": WRAPPERS,
    "easgd.async_centre": WRAPPERS,
    "easgd.optimizer": WRAPPERS,
    "easgd": WRAPPERS,
    "model_average": WRAPPERS,
    "towers": WRAPPERS,
    "replicate": WRAPPERS,
    "serving": WRAPPERS,
    "job_control": JOBS,
    "testing": JOBS,
    "": JOBS,  # the package itself exports everything
}


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


def test_every_module_has_a_layer():
    assert set(modules()) == set(LAYERS), set(modules()) ^ set(LAYERS)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_no_module_imports_a_higher_layer(name):
    path = modules()[name]
    for other in internal(imported(name, path)) - {name}:
        assert LAYERS[other] <= LAYERS[name], (
            f"{name} (layer {LAYERS[name]}) imports {other} (layer {LAYERS[other]})"
        )


@pytest.mark.parametrize("name", sorted(n for n, layer in LAYERS.items() if layer == ALGORITHMS))
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
        isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id == handler.name
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


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_no_exception_swallowed_without_a_log_line(name):
    tree = ast.parse(modules()[name].read_text())
    silent = [
        h.lineno
        for h in ast.walk(tree)
        if isinstance(h, ast.ExceptHandler) and _swallows(h) and not _logs(h)
    ]
    assert not silent, f"{name}: broad except without a log line at lines {silent}"


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_loggers_are_named_for_their_module(name):
    text = modules()[name].read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "getLogger":
            assert [ast.unparse(a) for a in node.args] == ["__name__"], name
