"""ShiftDetector: calibrated on held-out training runs, flags another framework's runs."""

import warnings

import numpy as np
import pytest

from skafa import DistributionShiftWarning, ShiftDetector, TurnFeatures
from skafa.testing import make_site_features


def _runs(n=90, seed=0):
    return make_site_features(n=n, n_sites=3, n_features=8, signal_site=0, seed=seed)[0]


def _other_framework(X, seed=1):
    """The same turns with their feature scales and correlations changed."""
    rng = np.random.default_rng(seed)
    mix = np.eye(X.n_features) + rng.normal(scale=0.8, size=(X.n_features,) * 2)
    return X.with_values(np.einsum("tsf,fg->tsg", X.values, mix) * 2.0)


def test_held_out_rate_near_one_minus_quantile_and_other_framework_flagged():
    train, held = _runs(seed=0), _runs(seed=5)
    det = ShiftDetector(n_components=5).fit(train)
    assert det.calibration_scores_.shape == (90,)
    assert det.threshold_ == pytest.approx(np.quantile(det.calibration_scores_, 0.975))
    assert det.lower_threshold_ == pytest.approx(np.quantile(det.calibration_scores_, 0.025))
    # fresh runs of the same kind: few flags; the other framework: (almost) all
    assert det.predict(held).mean() <= 0.15
    assert det.predict(_other_framework(held)).mean() >= 0.9


def test_two_sided_flags_runs_that_vary_less_than_the_training_runs():
    train, held = _runs(seed=0), _runs(seed=5)
    quiet = held.with_values(held.values * 0.3)
    assert ShiftDetector(n_components=5).fit(train).predict(quiet).mean() >= 0.9
    one = ShiftDetector(n_components=5, two_sided=False).fit(train)
    assert one.lower_threshold_ == -np.inf and one.predict(quiet).mean() <= 0.1


def test_a_lower_quantile_flags_more():
    train, held = _runs(seed=0), _runs(seed=5)
    strict = ShiftDetector(n_components=5, quantile=0.5).fit(train).predict(held).mean()
    loose = ShiftDetector(n_components=5, quantile=0.99).fit(train).predict(held).mean()
    assert strict > loose


def test_sites_are_respected_and_checked():
    X = _runs()
    det = ShiftDetector(sites=["s1"], n_components=3).fit(X)
    assert det.sites_ == ("s1",)
    # changing only another site does not move the scores
    v = X.values.copy()
    v[:, 2] *= 10
    np.testing.assert_allclose(det.score_samples(X.with_values(v)), det.score_samples(X))
    with pytest.raises(ValueError, match="lacks the sites"):
        det.score_samples(X.select_sites(["s0"]))
    with pytest.raises(ValueError, match="sites nope are not in X"):
        ShiftDetector(sites=["nope"]).fit(X)


def test_check_warns_naming_runs():
    X = _runs()
    det = ShiftDetector(n_components=5).fit(X)
    other = _other_framework(X)[[0, 1, 2]]
    with pytest.warns(DistributionShiftWarning, match=r"3 of 3 run\(s\) look unlike.*"
                                                      r"conversation 0"):
        flagged = det.check(other)
    assert flagged.all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        median = np.argsort(det.calibration_scores_)[X.n_conversations // 2]
        calm = det.check(X[[int(median)]])
    assert not calm.any()


def test_calibration_needs_enough_groups():
    X = _runs(n=12)
    one_task = TurnFeatures(X.values, X.offsets, sites=X.sites, task_ids=["t"] * 12)
    with pytest.raises(ValueError, match="1 task group.*cv=5"):
        ShiftDetector().fit(one_task)


def test_params_validated_and_fitted_state_checked():
    from sklearn.exceptions import NotFittedError

    with pytest.raises(ValueError, match="quantile"):
        ShiftDetector(quantile=1.5).fit(_runs())
    with pytest.raises(NotFittedError):
        ShiftDetector().predict(_runs())
