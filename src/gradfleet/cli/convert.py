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
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="convert checkpoints between TensorFlow/RETURNN and PyTorch")

#: A progress line is shown for checkpoints at least this large (bytes).
PROGRESS_MIN_BYTES = 64 << 20

OptimizerOpt = Annotated[
    str,
    typer.Option(
        "--optimizer",
        help="gradfleet optimizer: a name (adam) or a JSON config "
        '(\'{"class": "rmsprop", "learning_rate": 0.01, "centered": true}\')',
    ),
]
MapOpt = Annotated[
    Path, typer.Option("--map", "-m", help="Python file with get_model() and NAME_MAP")
]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="no progress line")]


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(2)


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


def _optimizer(spec: str, model: Any) -> Any:
    from gradfleet.registry import create_optimizer
    from gradfleet.tf_checkpoint.slot_names import optimizer_class

    try:
        config = json.loads(spec) if spec.lstrip().startswith("{") else spec
        opt = create_optimizer(model.parameters(), config)
        optimizer_class(opt)
    except (ValueError, TypeError) as exc:
        raise _fail(f"--optimizer {spec}: {exc}") from None
    return opt


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


@app.command("tf-checkpoint")
def tf_checkpoint(
    prefix: Annotated[str, typer.Argument(help="TF checkpoint prefix or directory")],
    optimizer: OptimizerOpt,
    map_file: MapOpt,
    out: Annotated[Path, typer.Option("--out", "-o", help="output directory")],
    quiet: QuietOpt = False,
) -> None:
    """TF checkpoint -> OUT/checkpoint.pt (model, optimizer state, global_step)."""
    import torch

    from gradfleet.tf_checkpoint import CheckpointMismatch, TensorFlowMissing, load_tf_checkpoint

    model, name_map = _model_and_map(map_file)
    opt = _optimizer(optimizer, model)
    progress = _ProgressLine("reading", quiet)
    try:
        loaded = load_tf_checkpoint(prefix, model, opt, name_map, progress=progress)
    except (CheckpointMismatch, FileNotFoundError, TensorFlowMissing, TypeError) as exc:
        raise _fail(str(exc).replace("\n", " ")) from None
    finally:
        progress.close()
    out.mkdir(parents=True, exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    state["global_step"] = loaded.global_step
    torch.save(state, out / "checkpoint.pt")
    print(f"wrote {out / 'checkpoint.pt'} ({len(loaded.used)} TF variables)")


@app.command("torch-checkpoint")
def torch_checkpoint(
    path: Annotated[Path, typer.Argument(help="checkpoint.pt written by tf-checkpoint")],
    optimizer: OptimizerOpt,
    map_file: MapOpt,
    out: Annotated[str, typer.Option("--out", "-o", help="TF checkpoint prefix to write")],
    quiet: QuietOpt = False,
) -> None:
    """OUT/checkpoint.pt -> a TF checkpoint that TF's Saver restores."""
    import torch

    from gradfleet.tf_checkpoint import TensorFlowMissing, save_tf_checkpoint

    model, name_map = _model_and_map(map_file)
    opt = _optimizer(optimizer, model)
    try:
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
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
