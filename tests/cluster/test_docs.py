"""docs/cluster.md: every ```python block runs, and does what the page says it does."""

from __future__ import annotations

import re
import subprocess

import pytest
from benchmarks.netcluster import PREFIX, unavailable_reason

from .netns import ROOT

PAGE = ROOT / "docs" / "cluster.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_python_blocks() -> None:
    assert len(_blocks()) == 2


def test_reading_the_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(_blocks()[1], namespace)  # noqa: S102 - the page's own example
    # the page: DDP's updates/s per scenario, and each link's use against its shaped rate
    assert set(namespace["ddp"]) == {"uniform", "slow-link", "slow-compute"}
    assert all(v > 0 for v in namespace["ddp"].values())
    assert all(0 <= u <= 1.1 for u in namespace["use"].values())


@pytest.mark.slow
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"{unavailable_reason()}")
def test_an_emulated_cluster_from_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    namespace: dict = {}
    exec(_blocks()[0], namespace)  # noqa: S102 - the page's own example
    # the page: two hosts with addresses, host 1 at 25 Mbit/s, and everything removed after
    assert len(namespace["addresses"]) == 2 and namespace["rates"] == {0: "100mbit", 1: "25mbit"}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespace["prefix"] not in listed and namespace["prefix"].startswith(PREFIX)
