"""SDE window schedules (sampling/windows.py) against hand-computed starts, and the uniform draw of Flow-GRPO-Fast's."""
import numpy as np
import pytest
from ml_collections import ConfigDict

from flowrl_jax.sampling import windows
from flowrl_jax.sampling.windows import sampler_levels


def _sampler(num_steps, sde_window, **window):
    return ConfigDict({"num_steps": num_steps, "sde_window": sde_window, "noise_level": 0.7, "kind": "sde",
                       "window": {**windows.DEFAULTS, **window}})


def test_sliding_window_moves_as_mixgrpo_and_wraps_or_holds():
    # MixGRPO: 25 steps, a window of 4 from 0, 1 step every 25 iterations; the last start that fits is 21.
    s = _sampler(25, (0, 4), schedule="sliding", shift_every=25, stride=1)
    starts = {it: windows.window_at(s, it, seed=0)[0] for it in (0, 24, 25, 49, 50, 525, 549, 550, 575)}
    assert starts == {0: 0, 24: 0, 25: 1, 49: 1, 50: 2, 525: 21, 549: 21, 550: 0, 575: 1}  # 550 // 25 = 22 -> wraps to 0
    held = _sampler(25, (0, 4), schedule="sliding", shift_every=25, stride=1, wrap=False)
    assert windows.window_at(held, 550, 0) == (21, 4) and windows.window_at(held, 10_000, 0) == (21, 4)
    levels = np.asarray(sampler_levels(s, windows.window_at(s, 50, 0)))
    np.testing.assert_array_equal(np.flatnonzero(levels), [2, 3, 4, 5])


def test_random_window_is_uniform_over_upstreams_starts_and_the_same_on_every_call():
    # flow_grpo-Fast: window 3 in range (0, 5) -> start uniform in {0, 1, 2} (random.randint(0, 5 - 3)).
    s = _sampler(10, (0, 3), schedule="random", range=(0, 5))
    starts = np.array([windows.window_at(s, it, seed=1)[0] for it in range(3000)])
    counts = np.bincount(starts, minlength=3)
    assert len(counts) == 3  # no start outside 0..2
    # each count ~ Binomial(3000, 1/3): mean 1000, sd 25.8; 5 sd (1 in 3.5 million per count) is 129
    assert np.all(np.abs(counts - 1000) < 129), counts
    assert [windows.window_at(s, it, seed=1) for it in range(5)] == [(int(a), 3) for a in starts[:5]]  # every process agrees
    assert windows.window_at(_sampler(10, (4, 3)), 7, 0) == (4, 3)  # fixed


@pytest.mark.parametrize("window, match", [({"schedule": "random", "range": (0, 2)}, r"sampler.window.range=\(0, 2\)"),
                                           ({"schedule": "sideways"}, "sampler.window.schedule"),
                                           ({"shift_eveyr": 3}, "unknown option.*sampler.window.shift_eveyr"),
                                           ({"tail_solver": "heun"}, "sampler.window.tail_solver='heun'"),
                                           ({"tail_ratio": 0.0}, "tail_ratio=0.0")])
def test_bad_window_options_name_the_key(window, match):
    s = _sampler(10, (0, 3))
    s.window = window
    with pytest.raises(ValueError, match=match):
        windows.window_at(s, 0, 0) if "tail" not in str(window) else windows.tail(s)
