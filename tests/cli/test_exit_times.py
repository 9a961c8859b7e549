"""The launcher names the rank that died first: ExitTimes orders ranks that ended in one
polling round by when the kernel saw each process exit, not by rank."""

from __future__ import annotations

import subprocess
import sys
import time

from gradfleet.cli.exit_times import ExitTimes


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_ranks_come_in_the_order_their_processes_exited() -> None:
    procs = {0: _sleeper(), 1: _sleeper(), 2: _sleeper()}
    try:
        exits = ExitTimes({r: p.pid for r, p in procs.items()})
        for rank in (2, 0, 1):  # killed in this order, each once the last one's exit was
            procs[rank].kill()  # noted (under CI load a fixed gap let two share one poll)
            deadline = time.monotonic() + 10
            while rank not in exits.exited() and time.monotonic() < deadline:
                time.sleep(0.01)
        for p in procs.values():  # then all reaped at once
            p.wait(10)
        assert exits.in_exit_order([0, 1, 2]) == [2, 0, 1]
    finally:
        for p in procs.values():
            p.kill()
            p.wait(10)


def test_a_restarted_rank_is_timed_by_its_new_process() -> None:
    """The launcher restarts rank 1: its first process's exit is forgotten, and the new one's
    exit, after rank 0's, orders it after rank 0."""
    first, zero = _sleeper(), _sleeper()
    exits = ExitTimes({0: zero.pid, 1: first.pid})
    again = None
    try:
        first.kill()
        first.wait(10)
        deadline = time.monotonic() + 10
        while 1 not in exits.exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        again = _sleeper()
        exits.watch(1, again.pid)
        assert exits.exited() == set()  # the restarted rank runs again
        for p in (zero, again):
            p.kill()
            deadline = time.monotonic() + 10
            while len(exits.exited()) < (1 if p is zero else 2) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert exits.in_exit_order([1, 0]) == [0, 1]
    finally:
        exits.close()
        for p in (first, zero, again):
            if p is not None:
                p.kill()
                p.wait(10)


def test_a_rank_without_an_exit_time_comes_last_in_the_order_given() -> None:
    gone = _sleeper()
    gone.kill()
    gone.wait(10)  # reaped: its pid cannot be watched (or belongs to no process of ours)
    live = _sleeper()
    try:
        exits = ExitTimes({5: gone.pid, 7: live.pid})
        live.kill()
        live.wait(10)
        assert exits.in_exit_order([5, 7], wait=1.0) == [7, 5]
    finally:
        live.kill()
        live.wait(10)


class _LateReport:
    """A process context whose exit is reported only at the ``after``-th poll."""

    def __init__(self, result: object, after: int) -> None:
        self.result, self.after = result, after

    def wait(self, timeout: float) -> object:
        self.after -= 1
        return self.result if self.after <= 0 else None


def test_the_launcher_waits_for_the_report_of_a_rank_that_exited_first() -> None:
    """Rank 1 is killed; its peer's failure is reported first, in a round where rank 1's is
    not yet: the launcher still handles rank 1 first."""
    from gradfleet.cli.launch import _reports_of_the_exited

    procs = {0: _sleeper(), 1: _sleeper(), 2: _sleeper()}
    try:
        exits = ExitTimes({r: p.pid for r, p in procs.items()})
        procs[1].kill()
        deadline = time.monotonic() + 10  # its exit noted first, however loaded the machine
        while 1 not in exits.exited() and time.monotonic() < deadline:
            time.sleep(0.01)
        procs[0].kill()
        for r in (0, 1):
            procs[r].wait(10)
        running = {0: _LateReport("rank 0", 1), 1: _LateReport("rank 1", 3), 2: None}
        ended = {0: "rank 0"}
        found = _reports_of_the_exited(running, ended, exits)
        assert found == {1: "rank 1"}  # rank 2 runs on: not waited for
        assert exits.in_exit_order({**ended, **found}) == [1, 0]
    finally:
        for p in procs.values():
            p.kill()
            p.wait(10)
