"""Who is in a group's next generation: here, or dead by a still heartbeat, or stuck; and who
falls silent while the group works."""

from __future__ import annotations

import pytest

from gradfleet.distributed.common.quorum import Quorum, Silence


def test_every_candidate_here_decides_at_once():
    q = Quorum([0, 1, 2], dead_after=1.0, timeout=10.0, start=0.0)
    assert q.observe(0.0, [0, 1, 2], {}) == [0, 1, 2]


def test_a_still_heartbeat_is_dead_after_dead_after_seconds():
    q = Quorum([0, 1, 2], dead_after=1.0, timeout=10.0, start=0.0)
    for t in (0.0, 0.3, 0.6, 0.9):
        assert q.observe(t, [0, 1], {2: 7}) is None  # not yet
    assert q.observe(1.0, [0, 1], {2: 7}) == [0, 1]
    assert q.dead == {2} and q.stuck == set()


def test_an_observer_that_was_not_watching_starts_its_clocks_again():
    """Starved of CPU for 2 s, the observer cannot tell a still counter from one it missed."""
    q = Quorum([0, 1, 2], dead_after=1.0, timeout=10.0, start=0.0)
    assert q.observe(0.0, [0, 1], {2: 7}) is None
    assert q.observe(2.0, [0, 1], {2: 7}) is None  # a gap of 2 s: not a silence it saw
    assert q.observe(2.4, [0, 1], {2: 7}) is None
    assert q.observe(2.8, [0, 1], {2: 7}) is None
    assert q.observe(3.0, [0, 1], {2: 7}) == [0, 1]  # 1 s watched


def test_a_beating_candidate_is_waited_for_until_it_arrives():
    q = Quorum([0, 1, 2], dead_after=1.0, timeout=10.0, start=0.0)
    for t in range(9):  # slow but alive: its counter moves every half second
        assert q.observe(t * 0.5, [0, 1], {2: t}) is None
    assert q.observe(4.6, [0, 1, 2], {}) == [0, 1, 2]


def test_alive_but_never_arriving_is_left_out_at_the_timeout():
    q = Quorum([0, 1, 2], dead_after=1.0, timeout=3.0, start=0.0)
    assert q.observe(2.5, [0, 1], {2: 25}) is None
    assert q.observe(3.0, [0, 1], {2: 30}) == [0, 1]
    assert q.stuck == {2} and q.dead == set()


def test_a_candidate_that_never_beat_is_dead_too():
    q = Quorum([0, 3], dead_after=0.5, timeout=5.0, start=0.0)
    assert q.observe(0.0, [0], {3: None}) is None
    assert q.observe(0.2, [0], {3: None}) is None
    assert q.observe(0.4, [0], {3: None}) is None
    assert q.observe(0.5, [0], {3: None}) == [0]


@pytest.mark.parametrize("dead_after", [0.0, -1.0, 11.0])
def test_dead_after_must_lie_in_the_timeout(dead_after):
    with pytest.raises(ValueError, match="dead_after must be in"):
        Quorum([0], dead_after=dead_after, timeout=10.0, start=0.0)


def test_silence_names_only_the_counters_that_stood_still():
    s = Silence(dead_after=1.0)
    assert s.observe(0.0, {1: 5, 2: 9}) == set()
    assert s.observe(0.4, {1: 6, 2: 9}) == set()
    assert s.observe(0.8, {1: 7, 2: 9}) == set()
    assert s.observe(1.0, {1: 8, 2: 9}) == {2}  # 2's counter still since 0.0
    assert s.observe(1.4, {1: 8, 2: 10}) == set()  # 2 beats again; 1 still for 0.4 s only


def test_silence_starts_its_clocks_again_after_a_gap_in_watching():
    s = Silence(dead_after=1.0)
    assert s.observe(0.0, {1: 5}) == set()
    assert s.observe(3.0, {1: 5}) == set()  # not watched between: no silence seen
    assert s.observe(3.5, {1: 5}) == set()
    assert s.observe(4.0, {1: 5}) == {1}


def test_silence_needs_a_positive_dead_after():
    with pytest.raises(ValueError, match="dead_after must be positive"):
        Silence(0.0)


def test_a_quorum_goes_on_from_the_silence_a_watch_saw():
    """A member blocked in a collective saw rank 2 still for 1 s: the generation after it is
    decided at once, not after another dead_after."""
    watch = Silence(dead_after=1.0)
    for t in (0.0, 0.25, 0.5, 0.75):
        assert watch.observe(t, {1: int(t * 40), 2: 7}) == set()
    assert watch.observe(1.0, {1: 40, 2: 7}) == {2}
    q = Quorum([0, 1, 2], dead_after=1.0, timeout=10.0, start=1.01, silence=watch)
    assert q.observe(1.01, [0, 1], {2: 7}) == [0, 1]
    assert q.dead == {2}
