"""The kernel tests' shared helpers (CPU): a race's negative control counts attempts."""
from __future__ import annotations

from ._checks import RACE_ATTEMPTS, first_catch


def test_first_catch_stops_at_the_first_catch():
    calls = []

    def attempt():
        calls.append(1)
        return len(calls) == 3
    assert first_catch(attempt) == 3
    assert len(calls) == 3          # no attempt after the catch


def test_first_catch_gives_up_after_its_attempts():
    """Negative control: a broken variant never caught (the race never happens) fails the control."""
    calls = []

    def never():
        calls.append(1)
        return False
    assert first_catch(never) is None
    assert len(calls) == RACE_ATTEMPTS
    late = iter([False, False, True])
    assert first_catch(lambda: next(late), attempts=2) is None
