"""``gradfleet convert``: TF checkpoints <-> torch checkpoints with the optimizer state.

``gradfleet convert tf-checkpoint PREFIX --optimizer adam --map map.py -o out/`` reads a TF1
``Saver`` checkpoint into the model that ``map.py``'s ``get_model()`` builds and the gradfleet
optimizer ``--optimizer`` names, and writes ``out/checkpoint.pt`` (``{"model": state_dict,
"optimizer": state_dict, "global_step": int}``, loadable with ``weights_only=True``).
``gradfleet convert torch-checkpoint out/checkpoint.pt ... -o tf/model.ckpt`` goes back.

``map.py`` defines ``get_model()`` and ``NAME_MAP`` (see ``gradfleet.tf_checkpoint.names``;
``TRANSPOSE`` is predefined there).  Every bad input is one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from .command_classes import Command, Group

app = typer.Typer(
    cls=Group,
    help="convert checkpoints between TensorFlow/RETURNN and PyTorch",
    rich_markup_mode="rich",
)

#: A progress line is shown for checkpoints at least this large (bytes).
PROGRESS_MIN_BYTES = 64 << 20

# --optimizer, --map and --out are required, and checked after the checkpoint's path: a
# mistyped path is the first thing to report (click would ask for the options first).
OptimizerOpt = Annotated[
    str | None,
    typer.Option(
        "--optimizer",
        metavar="NAME|JSON",
        help="required: gradfleet optimizer, a name (adam) or a JSON config "
        '(\'{"class": "rmsprop", "learning_rate": 0.01, "centered": true}\')',
        show_default=False,
    ),
]
MapOpt = Annotated[
    Path | None,
    typer.Option(
        "--map",
        "-m",
        metavar="FILE.py",
        help="required: Python file with get_model() and NAME_MAP",
        show_default=False,
    ),
]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", metavar="", help=escape("no progress line [default: off]")),
]


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(2)


def _given(value: Any, flag: str) -> Any:
    if value is None:
        raise _fail(f"missing option {flag}")
    return value


def _model_and_map(map_file: Path) -> tuple[Any, Any]:
    import torch

    from gradfleet.tf_checkpoint.names import IDENTITY, TRANSPOSE, Transform

    if not map_file.is_file():
        raise _fail(f"--map {map_file}: no such file")
    namespace: dict[str, Any] = {"TRANSPOSE": TRANSPOSE, "IDENTITY": IDENTITY}
    namespace["Transform"] = Transform
    try:
        exec(compile(map_file.read_text(), str(map_file), "exec"), namespace)
        model = namespace["get_model"]() if "get_model" in namespace else None
    except Exception as exc:  # the user's file: report whatever it raised, in one line
        raise _fail(f"--map {map_file}: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, torch.nn.Module):
        raise _fail(f"--map {map_file}: must define get_model() returning a torch.nn.Module")
    return model, namespace.get("NAME_MAP")


def _optimizer_spec(spec: str) -> tuple[type, dict[str, Any]]:
    """``--optimizer`` as (gradfleet class, the arguments given)."""
    from gradfleet.registry import GRADFLEET_OPTIMIZERS
    from gradfleet.tf_checkpoint.slot_names import SLOT_ORDER

    from .config import ConfigError, parse_spec
    from .optimizer_choice import lookup, shortest_names

    layouts = tuple(SLOT_ORDER)  # the classes with a TF checkpoint layout (and subclasses)
    choices = shortest_names(GRADFLEET_OPTIMIZERS)
    with_layout = {name: cls for name, cls in choices.items() if issubclass(cls, layouts)}
    try:
        if spec.lstrip().startswith("{"):
            given = json.loads(spec)
            if not isinstance(given, dict) or "class" not in given:
                raise ValueError("a JSON config needs a 'class' entry")
            name = given.pop("class")
        else:
            name, given = parse_spec(spec, "optimizer")
        cls = lookup(name, with_layout)
    except (ConfigError, ValueError, TypeError) as exc:
        raise _fail(f"--optimizer {spec}: {exc}") from None
    if not issubclass(cls, layouts):
        known = ", ".join(sorted(c.__name__ for c in SLOT_ORDER))
        raise _fail(
            f"--optimizer {spec}: {cls.__name__} has no TensorFlow checkpoint layout; "
            f"gradfleet knows {known}"
        )
    return cls, given


def _build(spec: str, cls: type, given: dict[str, Any], model: Any) -> Any:
    from gradfleet.registry import create_optimizer

    try:
        return create_optimizer(model.parameters(), {"class": cls, **given})
    except (ValueError, TypeError) as exc:
        raise _fail(f"--optimizer {spec}: {exc}") from None


def _from_graph(spec: str, cls: type, given: dict[str, Any], prefix: str, variables) -> Any:
    """The TF run's hyperparameters: those of TF's graph (``PREFIX.meta``) with those given
    in ``--optimizer``, which must agree with the graph; one required where the graph has
    none.  Returns (constructor arguments, the graph's findings)."""
    from gradfleet.tf_checkpoint import graph_hyperparameters as gh

    try:
        graph = gh.read_graph_hyperparameters(prefix, cls, variables)
    except gh.GraphMismatch as exc:
        raise _fail(f"--optimizer {spec}: {exc}") from None
    given_tf = gh.tf_keywords(cls, given)
    clashes = gh.disagreements(cls, given_tf, graph)
    if clashes:
        raise _fail(
            f"--optimizer {spec}: the TF run trained with other values: "
            + "; ".join(clashes)
            + ". Leave them out to continue the TF run (change them after loading to change it)"
        )
    absent = {k: why for k, why in graph.missing.items() if k not in given_tf}
    if absent:
        by_reason: dict[str, list[str]] = {}
        for key, why in absent.items():
            by_reason.setdefault(why, []).append(key)
        reasons = "; ".join(f"{', '.join(keys)}: {why}" for why, keys in by_reason.items())
        name = cls.__name__.removesuffix("Optimizer").lower()
        example = ",".join(f"{k}=VALUE" for k in absent)
        raise _fail(
            f"--optimizer {spec}: the TF graph does not hold {', '.join(absent)} ({reasons}). "
            f"Give the values the TF run used: --optimizer '{name}:{example}'"
        )
    return {**graph.values, **given}, graph


class _ProgressLine:
    """``progress(done, total)`` as one line on stderr, for checkpoints worth waiting for."""

    def __init__(self, label: str, quiet: bool) -> None:
        self.label, self.quiet, self.bar = label, quiet, None

    def __call__(self, done: int, total: int) -> None:
        if self.quiet or total < PROGRESS_MIN_BYTES:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=self.label)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


FreshSlotsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--fresh-slots",
        metavar="NAME",
        help=escape(
            "a parameter (torch name) whose optimizer slots start afresh where the checkpoint "
            "has none (repeat for several) [default: none]"
        ),
    ),
]


@app.command("tf-checkpoint", cls=Command)
def tf_checkpoint(
    prefix: Annotated[str, typer.Argument(help="TF checkpoint prefix or directory")],
    optimizer: OptimizerOpt = None,
    map_file: MapOpt = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", metavar="DIR", help="required: output directory"),
    ] = None,
    fresh_slots: FreshSlotsOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """TF checkpoint -> OUT/checkpoint.pt (model, optimizer state, global_step), with the
    hyperparameters of the TF graph (PREFIX.meta)."""
    from gradfleet.tf_checkpoint.bundle import check_checkpoint_path, quiet_tensorflow

    try:  # from the files alone, before anything is imported for the conversion
        check_checkpoint_path(prefix)
    except FileNotFoundError as exc:
        raise _fail(str(exc)) from None
    cls, given = _optimizer_spec(_given(optimizer, "--optimizer"))
    map_file, out = _given(map_file, "--map"), _given(out, "--out")
    with quiet_tensorflow():
        _tf_checkpoint(prefix, optimizer, cls, given, map_file, out, fresh_slots or [], quiet)


def _tf_checkpoint(prefix, optimizer, cls, given, map_file, out, fresh_slots, quiet) -> None:
    import torch

    from gradfleet.tf_checkpoint import (
        CheckpointMismatch,
        CheckpointReader,
        TensorFlowMissing,
        load_tf_checkpoint,
    )
    from gradfleet.tf_checkpoint.names import resolve

    model, name_map = _model_and_map(map_file)
    try:
        prefix = CheckpointReader(prefix).prefix  # a directory: its latest checkpoint
        variables = [e[0] for k in model.state_dict() if (e := resolve(name_map, k))]
    except (FileNotFoundError, TensorFlowMissing, TypeError) as exc:
        raise _fail(str(exc)) from None
    kwargs, graph = _from_graph(optimizer, cls, given, prefix, variables)
    opt = _build(optimizer, cls, kwargs, model)
    progress = _ProgressLine("reading", quiet)
    try:
        loaded = load_tf_checkpoint(
            prefix, model, opt, name_map, progress=progress, fresh_slots=fresh_slots
        )
    except (CheckpointMismatch, FileNotFoundError, TensorFlowMissing, TypeError) as exc:
        raise _fail(str(exc).replace("\n", " ")) from None
    except ValueError as exc:  # --fresh-slots naming no parameter
        raise _fail(f"--fresh-slots: {exc}") from None
    finally:
        progress.close()
    out.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    state["global_step"] = loaded.global_step
    torch.save(state, out / "checkpoint.pt")
    used = ", ".join(
        f"{k}={v!r} ({'TF graph' if k in graph.values and k not in given else 'given'})"
        for k, v in kwargs.items()
    )
    print(f"wrote {out / 'checkpoint.pt'} ({len(loaded.used)} TF variables)")
    print(f"{cls.__name__}: {used}")


@app.command("torch-checkpoint", cls=Command)
def torch_checkpoint(
    path: Annotated[Path, typer.Argument(help="checkpoint.pt written by tf-checkpoint")],
    optimizer: OptimizerOpt = None,
    map_file: MapOpt = None,
    out: Annotated[
        str | None,
        typer.Option(
            "--out", "-o", metavar="PREFIX", help="required: TF checkpoint prefix to write"
        ),
    ] = None,
    quiet: QuietOpt = False,
) -> None:
    """OUT/checkpoint.pt -> a TF checkpoint that TF's Saver restores."""
    from gradfleet.tf_checkpoint.bundle import quiet_tensorflow

    if not path.is_file():
        raise _fail(f"{path}: no such file")
    cls, given = _optimizer_spec(_given(optimizer, "--optimizer"))
    map_file, out = _given(map_file, "--map"), _given(out, "--out")
    with quiet_tensorflow():
        _torch_checkpoint(path, optimizer, cls, given, map_file, out, quiet)


def _torch_checkpoint(path, optimizer, cls, given, map_file, out, quiet) -> None:
    import torch

    from gradfleet.optimizer import HyperparametersReplacedWarning
    from gradfleet.tf_checkpoint import TensorFlowMissing, save_tf_checkpoint

    model, name_map = _model_and_map(map_file)
    opt = _build(optimizer, cls, given, model)
    try:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        with warnings.catch_warnings():
            # A TF checkpoint holds no hyperparameters: which ones the groups hold is moot.
            warnings.simplefilter("ignore", HyperparametersReplacedWarning)
            opt.load_state_dict(state["optimizer"])
    except (OSError, KeyError, RuntimeError, ValueError) as exc:
        raise _fail(f"{path}: {type(exc).__name__}: {exc}".replace("\n", " ")) from None
    progress = _ProgressLine("writing", quiet)
    try:
        prefix = save_tf_checkpoint(
            out, model, opt, name_map, global_step=state.get("global_step"), progress=progress
        )
    except (TensorFlowMissing, ValueError, TypeError) as exc:
        raise _fail(str(exc)) from None
    finally:
        progress.close()
    print(f"wrote {prefix}")
