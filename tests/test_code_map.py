"""``docs/code-map.md`` names every module of the packages it maps, each where it lives, and
every function its trails name exists."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "code-map.md"
SRC = ROOT / "src" / "gradfleet"
#: the packages the page maps (``distributed`` has its own page, checked by its tests)
PACKAGES = ("", "optimizers", "kernels", "cli", "tf_checkpoint")


def sections() -> dict[str, str]:
    """Each mapped package's section, by the folder its heading names."""
    out = {}
    for heading, body in re.findall(r"^## .*?\(`src/gradfleet/(\S*?)/?`\)\n(.*?)(?=^## |\Z)",
                                    DOC.read_text(), flags=re.S | re.M):  # fmt: skip
        out[heading.removeprefix("src/gradfleet").strip("/")] = body
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_on_the_page_under_its_package(package):
    body = sections()[package]
    table = "\n".join(line for line in body.splitlines() if line.startswith("| `"))
    named = set(re.findall(r"`([\w.]+\.py)`", table))
    present = {p.name for p in (SRC / package).glob("*.py")}
    assert named == present, (
        f"{package or 'gradfleet'}: missing {present - named}, gone {named - present}"
    )


def trail_functions(text: str) -> list[str]:
    """The dotted names of a page's trail tables (rows ``| N | `gradfleet...` |``)."""
    return re.findall(r"^\| \d+ \| `(gradfleet\.[\w.]+)` \|", text, flags=re.M)


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{dotted}: no such module")


def test_every_function_a_trail_names_exists():
    names = trail_functions(DOC.read_text())
    assert len(names) >= 5
    for dotted in names:
        assert callable(resolve(dotted)), dotted
