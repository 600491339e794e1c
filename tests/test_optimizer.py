"""The train job's learning rate (`rl/state.learning_rate`, `train.lr_schedule`) against its closed form."""
import numpy as np
from ml_collections import ConfigDict

from flowrl_jax.rl.state import learning_rate


def test_cosine_lr_schedule_follows_the_closed_form_and_ends_at_a_tenth():
    t_cfg = ConfigDict(dict(lr=3e-4, lr_schedule="cosine", iterations=10, num_inner_epochs=2, minibatches=3))
    schedule, total = learning_rate(t_cfg), 10 * 2 * 3
    for count in (0, 1, 17, 30, 59, 60, 75):
        expected = 3e-4 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(count, total) / total)))  # decays to a tenth, then stays
        np.testing.assert_allclose(float(schedule(count)), expected, rtol=1e-6)  # float32 cos of a value in [0, pi]: ~1e-7 relative


def test_constant_lr_is_the_number_itself():
    assert learning_rate(ConfigDict(dict(lr=3e-4, lr_schedule="constant"))) == 3e-4
