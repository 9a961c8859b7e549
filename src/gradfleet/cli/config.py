"""RETURNN-style run configuration: config files, ``name:key=value`` specs, merging with flags.

A config file is Python (run in a fresh namespace, as RETURNN does) or JSON. Its entries are
the training settings: ``optimizer = {"class": "adam", "epsilon": 1e-8}``, ``learning_rate``
(RETURNN's top-level learning rate) and the keys of :class:`gradfleet.cli.spec.RunSpec`
(``workload``, ``strategy``, ``workers``, ``steps``, ...). Command-line flags override the file.
"""

from __future__ import annotations

import ast
import json
import runpy
from pathlib import Path
from typing import Any

__all__ = ["ConfigError", "load_config", "optimizer_config", "parse_spec", "parse_straggler"]


class ConfigError(ValueError):
    """Bad user input: the CLI prints it as one ``error:`` line."""


def _value(text: str) -> Any:
    """``"0.1"`` -> 0.1, ``"true"`` -> True, ``"[1,2]"`` -> [1, 2], anything else a string."""
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_spec(spec: str, what: str) -> tuple[str, dict[str, Any]]:
    """``"adam:learning_rate=0.01,beta1=0.8"`` -> ``("adam", {...})``."""
    name, _, rest = spec.strip().partition(":")
    if not name:
        raise ConfigError(f"empty {what} name in {spec!r}")
    args: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{what} {spec!r}: expected key=value, got {item!r}")
        args[key.strip()] = _value(val.strip())
    return name.strip(), args


def parse_straggler(text: str) -> tuple[int, float]:
    """``"1:50"`` -> rank 1 sleeps 50 ms per step."""
    rank, sep, delay = str(text).partition(":")
    try:
        if not sep:
            raise ValueError
        r, d = int(rank), float(delay)
    except ValueError:
        raise ConfigError(f"--straggler expects RANK:DELAY_MS, got {text!r}") from None
    if r < 0 or d < 0:
        raise ConfigError(f"--straggler: rank and delay must be >= 0, got {text!r}")
    return r, d


def _from_python(path: Path) -> dict[str, Any]:
    try:
        namespace = runpy.run_path(str(path), run_name="__gradfleet_config__")
    except SyntaxError as err:
        raise ConfigError(f"{path}:{err.lineno}: syntax error: {err.msg}") from None
    except Exception as err:  # a config is user code: any failure is bad input
        raise ConfigError(f"{path}: {type(err).__name__}: {err}") from None
    return {k: v for k, v in namespace.items() if not k.startswith("_")}


def _from_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of settings")
    return data


def load_config(path_text: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The settings named in ``keys`` of a ``.py`` / ``.json`` config file (others are
    ignored: a RETURNN config holds much else)."""
    path = Path(path_text)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.suffix == ".json":
        raw = _from_json(path)
    elif path.suffix == ".py":
        raw = _from_python(path)
    else:
        raise ConfigError(f"config file {path} must end in .py or .json")
    settings = {k: raw[k] for k in keys if k in raw}
    opt = settings.get("optimizer")
    if opt is not None and not isinstance(opt, (str, dict)):
        raise ConfigError(f"{path}: optimizer must be a dict with a 'class' entry or a name")
    if isinstance(opt, dict) and "class" not in opt:
        raise ConfigError(f"{path}: optimizer dict needs a 'class' entry")
    strategy = settings.get("strategy")
    if isinstance(strategy, dict):  # {"class": "easgd", "period": 4} -> "easgd:period=4"
        if "class" not in strategy:
            raise ConfigError(f"{path}: strategy dict needs a 'class' entry")
        args = {k: v for k, v in strategy.items() if k != "class"}
        settings["strategy"] = (strategy["class"], args)
    return settings


def optimizer_config(spec: str | dict[str, Any], learning_rate: float | None) -> dict[str, Any]:
    """A registry config dict from a spec string or dict, with an optional learning rate."""
    if isinstance(spec, dict):
        opts = dict(spec)
    else:
        name, args = parse_spec(spec, "optimizer")
        opts = {"class": name, **args}
    if learning_rate is not None:
        opts.pop("lr", None)
        opts["learning_rate"] = learning_rate
    return opts
