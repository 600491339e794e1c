"""The statistics the method comparison reports (benchmarks/compare_methods.py, benchmarks/gradient_snr.py), against
closed forms and Monte Carlo: Student and Welch intervals, the unbiased signal estimate and its interval's coverage."""
import numpy as np
from scipy import stats

from benchmarks import compare_methods, gradient_snr


def test_student_and_welch_intervals_match_scipy():
    a, b = np.array([0.31, 0.28, 0.35]), np.array([0.25, 0.27, 0.22, 0.24])
    mean, half = compare_methods.interval(a)
    lo, hi = stats.t.interval(0.95, 2, loc=a.mean(), scale=stats.sem(a))
    np.testing.assert_allclose([mean - half, mean + half], [lo, hi], rtol=1e-12)  # the same float64 formula: rounding only
    diff, half = compare_methods.welch(a, b)
    res = stats.ttest_ind(a, b, equal_var=False)
    ci = res.confidence_interval(0.95)
    np.testing.assert_allclose([diff - half, diff + half], [ci.low, ci.high], rtol=1e-10)  # float64; scipy's dof rearranged
    assert np.isnan(compare_methods.interval([0.3])[1])  # one seed: no interval, said so in the table


def test_signal_estimate_is_unbiased_and_its_interval_covers():
    # K gradients g_k = mu + noise: the estimate of ||mu||^2 averages to the truth (within 4 standard errors of 400
    # repeats), the plain ||mean g||^2 is biased up by tr(Sigma) / K, and the 95% interval covers mu in >= 88% of
    # repeats (the jackknife's normal interval at K = 32; 400 repeats put the binomial std of the rate near 1.1%).
    rng = np.random.default_rng(0)
    mu = rng.normal(size=200) * 0.1
    est, naive, covered = [], [], []
    for _ in range(400):
        g = mu + rng.normal(size=(32, 200))
        out = gradient_snr.signal_and_noise(g)
        est.append(out["mu2"])
        naive.append(float((g.mean(0) ** 2).sum()))
        covered.append(out["mu2_ci95"][0] <= (mu**2).sum() <= out["mu2_ci95"][1])
    truth = (mu**2).sum()
    assert abs(np.mean(est) - truth) < 4 * np.std(est) / np.sqrt(400)
    assert np.mean(naive) - truth > 0.8 * 200 / 32  # the bias the U-statistic removes
    assert np.mean(covered) >= 0.88
    np.testing.assert_allclose(out["trace_sigma"], 200, rtol=0.15)  # mean of 200 chi2(31)/31: sd 0.018, 0.15 is 8 sd
