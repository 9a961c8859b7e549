"""A checkpoint on a worker whose standby has taken a dedicated server over writes that server's
file, whether or not the launcher has reported the loss yet (CI once saw the report come
after the checkpoint began: rank 0 then waited for a file no rank would write)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gradfleet.cli import worker


class Control:
    """The job's control keys as one worker (rank 1 of 3, one dedicated server: rank 3)
    sees them; records the files said to be saved."""

    def __init__(self, lost: list[int], rejoined: dict[int, tuple[int, int]]) -> None:
        self.lost, self.back = lost, rejoined
        self.saved: list[tuple[int, int]] = []

    def checkpoint_saved(self, step: int, rank: int) -> None:
        pass

    def lost_workers(self, ranks: Any) -> dict[int, dict]:
        return {r: {} for r in ranks if r in self.lost}

    def rejoined(self, rank: int) -> tuple[int, int] | None:
        return self.back.get(rank)

    def server_checkpoint_saved(self, step: int, rank: int) -> None:
        self.saved.append((step, rank))

    def wait_checkpoint_released(self, step: int, timeout: float) -> None:
        pass


def _save(tmp_path: Path, control: Control, holds: set[int]) -> Control:
    model = torch.nn.Linear(2, 1)
    strategy = SimpleNamespace(
        leader=lambda: 0,
        model=model,
        opt=torch.optim.SGD(model.parameters(), lr=0.1),
        bytes_sent=0,
        server_state=lambda r: {"kind": "test", "rank": r} if r in holds else None,
    )
    job = SimpleNamespace(rank=1, control=control, servers=1, workers=3, timeout=5.0)
    worker._save_checkpoint(tmp_path, 100, job, strategy, {})  # type: ignore[arg-type]
    return control


def test_the_standby_writes_the_servers_file_before_the_loss_is_reported(tmp_path: Path) -> None:
    control = _save(tmp_path, Control(lost=[], rejoined={}), holds={3})
    assert control.saved == [(100, 3)]
    saved = torch.load(tmp_path / "checkpoints" / "step-0000100" / "rank-3.pt", weights_only=True)
    assert saved == {"kind": "test", "rank": 3}


def test_a_server_that_came_back_writes_its_own(tmp_path: Path) -> None:
    # rank 3 rejoined after its loss: the standby here no longer stands in for it
    control = _save(tmp_path, Control(lost=[], rejoined={3: (60, 1234)}), holds={3})
    assert control.saved == []
    assert not (tmp_path / "checkpoints" / "step-0000100" / "rank-3.pt").exists()


def test_a_worker_that_holds_no_server_writes_none(tmp_path: Path) -> None:
    control = _save(tmp_path, Control(lost=[3], rejoined={}), holds=set())
    assert control.saved == []
