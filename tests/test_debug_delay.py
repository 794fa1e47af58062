"""The calibration delay (runtime.debug): a timed delay lengthens the recorded steps by its fraction;
an untimed one runs (the decode takes longer) but is left out of the recorded steps."""
import time

import pytest

from runtime.config import ConfigError, runtime_config_from_dict
from tests.conftest import make_engine

PROMPT = list(range(3, 40))


def _recorded_share(**debug):
    """(sum of recorded step durations) / (wall time of the decode), and the step count."""
    eng = make_engine(draft={"policy": "fixed", "fixed_depth": 3}, debug=debug)
    eng.generate(PROMPT, seed=1, max_new_tokens=4)               # warm
    rnd, st = eng.start(PROMPT, 1, 24)
    t0 = time.perf_counter_ns()
    g = eng.decode(rnd, st)
    wall = time.perf_counter_ns() - t0
    return sum(g.step_ns) / wall, len(g.step_ns)


def test_timed_delay_is_recorded_untimed_is_not():
    # fraction 1.0: every step waits as long as its work, so an untimed delay hides half the wall
    timed, n1 = _recorded_share(step_delay_fraction=1.0)
    untimed, n2 = _recorded_share(step_delay_fraction=1.0, step_delay_timed=False)
    plain, _ = _recorded_share()
    assert n1 == n2 >= 3
    assert timed > 0.9 and plain > 0.9            # the steps account for (nearly) all of the decode
    assert 0.3 < untimed < 0.62                   # about half: the waits ran but were not recorded
    # negative control: the timed run must fail the untimed run's check
    assert not (0.3 < timed < 0.62)


def test_delay_settings_are_validated():
    with pytest.raises(ConfigError, match="step_delay_timed"):
        runtime_config_from_dict({"debug": {"step_delay_timed": "false"}})
    with pytest.raises(ConfigError, match="step_delay_fraction"):
        runtime_config_from_dict({"debug": {"step_delay_fraction": -0.1}})
