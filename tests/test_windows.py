"""SDE window schedules (sampling/windows.py) against hand-computed starts, and the uniform draw of Flow-GRPO-Fast's."""
import numpy as np
import pytest
from ml_collections import ConfigDict

from flowrl_jax.sampling import windows
from flowrl_jax.sampling.windows import sampler_levels


def _sampler(num_steps, sde_window, **window):
    return ConfigDict({"num_steps": num_steps, "sde_window": sde_window, "noise_level": 0.7, "kind": "sde",
                       "window": {**windows.DEFAULTS, **window}})


class MixGRPOStates:
    """A transcription of MixGRPO's `fastvideo/utils/grpo_states.py` progressive strategy (commit e5cdd6a), the
    reference the sliding schedule is checked against: `update_iteration` after each iteration's
    `get_current_timesteps`, `max_timesteps = sampling_steps - 2` (`train_grpo_flux.py`)."""

    def __init__(self, sampling_steps, group_size, init_timestep, iters_per_group, overlap_step, roll_back):
        self.max_timesteps, self.group_size, self.init = sampling_steps - 2, group_size, init_timestep
        self.iters_per_group, self.overlap_step, self.roll_back = iters_per_group, overlap_step, roll_back
        self.cur_timestep, self.cur_iter_in_group = init_timestep, 0

    def get_current_timesteps(self):
        return list(range(self.cur_timestep, min(self.cur_timestep + self.group_size, self.max_timesteps)))

    def update_iteration(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.overlap_step
        if self.cur_timestep > self.max_timesteps:
            if self.roll_back:
                self.cur_timestep, self.cur_iter_in_group = self.init, 0
            else:
                self.cur_timestep = self.max_timesteps


@pytest.mark.parametrize("steps,size,start,every,stride,wrap", [(25, 4, 0, 25, 1, True), (25, 3, 0, 20, 1, True),
                                                               (10, 2, 0, 3, 1, True), (10, 2, 1, 2, 2, True),
                                                               (12, 4, 0, 2, 1, False)])
def test_sliding_window_follows_mixgrpos_states_through_the_end(steps, size, start, every, stride, wrap):
    """Every iteration's trained steps equal upstream's, through the end of the schedule (windows cut at T - 2, empty at
    start T - 2) and the roll back (or the clip without it), over several full cycles."""
    s = _sampler(steps, (start, size), schedule="sliding", shift_every=every, stride=stride, wrap=wrap)
    ref = MixGRPOStates(steps, size, start, every, stride, wrap)
    for it in range(every * (steps + 3) * 2):
        lo, n = windows.window_at(s, it, seed=0)
        expected = ref.get_current_timesteps()
        assert list(range(lo, lo + n)) == expected, (it, lo, n, expected)
        assert list(np.flatnonzero(sampler_levels(s, (lo, n)))) == expected
        ref.update_iteration()


def test_the_whole_window_rule_keeps_the_size_and_wraps_at_the_last_start_that_fits():
    # end="whole" (the earlier rule): 25 steps, a window of 4 from 0, 1 step every 25 iterations; last start 21.
    s = _sampler(25, (0, 4), schedule="sliding", shift_every=25, stride=1, end="whole")
    starts = {it: windows.window_at(s, it, seed=0) for it in (0, 25, 525, 550)}
    assert starts == {0: (0, 4), 25: (1, 4), 525: (21, 4), 550: (0, 4)}  # 550 // 25 = 22 -> wraps to 0


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
