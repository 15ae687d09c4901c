"""Tests for skafa.metrics on unlabelled conversations (y_true None or -1): skipped, counted."""

import functools
import warnings

import numpy as np
import pytest

from skafa.conversation import Conversation, Turn
from skafa.metrics import (
    agent_accuracy,
    agent_accuracy_scorer,
    bootstrap_ci,
    drop_unlabelled,
    exact_f1,
    lenient_step_accuracy,
    lenient_step_matches,
    mean_absolute_step_shift,
    paired_bootstrap_ci,
    step_accuracy,
    step_accuracy_scorer,
    top_k_step_accuracy,
    within_k_accuracy,
)


def _no_warning(func, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return func(*args, **kwargs)


# y_true with two unlabelled conversations (None and -1) among five
Y_TRUE = [0, None, 2, -1, 4]
Y_PRED = [0, 3, 1, 0, 4]
LABELLED = ([0, 2, 4], [0, 1, 4])


@pytest.mark.parametrize("metric", [
    step_accuracy, lenient_step_accuracy, within_k_accuracy, mean_absolute_step_shift,
    functools.partial(within_k_accuracy, k=0),
])
@pytest.mark.parametrize("as_array", [False, True])
def test_step_metrics_skip_unlabelled_and_count_them(metric, as_array):
    y_true = np.array(Y_TRUE, dtype=object) if as_array else Y_TRUE
    name = getattr(metric, "__name__", None) or metric.func.__name__
    with pytest.warns(UserWarning, match=rf"{name}: skipped 2 unlabelled conversation\(s\) "
                                         r"of 5 .*scoring the 3 labelled ones") as record:
        score = metric(y_true, Y_PRED)
    assert len(record) == 1
    assert score == _no_warning(metric, *LABELLED)


def test_int_array_with_minus_one_is_skipped():
    y_true = np.array([1, -1, 2], dtype=np.int64)
    with pytest.warns(UserWarning, match="skipped 1 unlabelled conversation"):
        assert step_accuracy(y_true, [1, 0, 2]) == 1.0
    with pytest.warns(UserWarning, match="skipped 1 unlabelled conversation"):
        assert step_accuracy(y_true.astype(float), [1, 0, 2]) == 1.0


def test_labelled_input_gives_no_warning():
    assert _no_warning(step_accuracy, [0, 1], [0, 0]) == 0.5


def test_all_unlabelled_is_an_error():
    with pytest.raises(ValueError, match=r"step_accuracy: all 2 conversations are unlabelled"):
        step_accuracy([None, -1], [0, 0])


def test_a_prediction_of_minus_one_is_still_refused():
    with pytest.raises(ValueError, match=r"y_pred\[1\]=-1 is negative"):
        step_accuracy([0, 1], [0, -1])


def test_lengths_are_checked_before_skipping():
    with pytest.raises(ValueError, match="different lengths"):
        step_accuracy([0, -1, 1], [0, 1])


def test_top_k_skips_unlabelled_with_their_scores():
    scores = [[0.9, 0.1], [0.5], [0.1, 0.2, 0.7]]
    with pytest.warns(UserWarning, match="top_k_step_accuracy: skipped 1 unlabelled"):
        assert top_k_step_accuracy([0, -1, 2], scores, k=1) == 1.0


def test_agent_accuracy_skips_unlabelled_agents():
    with pytest.warns(UserWarning, match=r"agent_accuracy: skipped 1 unlabelled .* of 3"):
        assert agent_accuracy(["a", None, "b"], ["a", "a", "c"]) == 0.5
    with pytest.raises(TypeError, match=r"y_pred_agents\[1\]=None"):
        agent_accuracy(["a", "b"], ["a", None])
    with pytest.raises(ValueError, match="all 1 conversations are unlabelled"):
        agent_accuracy([None], ["a"])


def test_per_conversation_hits_refuse_unlabelled_and_point_to_drop_unlabelled():
    with pytest.raises(ValueError, match=r"y_true\[1\] is unlabelled.*drop_unlabelled"):
        lenient_step_matches([0, -1], [0, 1])
    with pytest.warns(UserWarning, match="skipped 1 unlabelled"):
        y, p = drop_unlabelled([0, -1], [0, 1])
    assert lenient_step_matches(y, p).tolist() == [True]


@pytest.mark.parametrize("metric", [step_accuracy, functools.partial(within_k_accuracy, k=2),
                                    mean_absolute_step_shift])
def test_bootstrap_drops_unlabelled_once(metric):
    rng = np.random.RandomState(0)
    y = rng.randint(0, 5, 30)
    p = np.where(rng.rand(30) < 0.5, y, 0)
    groups = np.arange(30) // 3
    y_mixed = y.copy()
    y_mixed[[1, 7, 20]] = -1
    keep = y_mixed >= 0
    with pytest.warns(UserWarning, match="bootstrap_ci: skipped 3 unlabelled") as record:
        mixed = bootstrap_ci(y_mixed, p, metric, n_resamples=200, random_state=0,
                             groups=groups)
    assert len(record) == 1
    clean = _no_warning(bootstrap_ci, y[keep], p[keep], metric, n_resamples=200,
                        random_state=0, groups=groups[keep])
    assert mixed == clean and mixed.n == 27
    with pytest.warns(UserWarning, match="paired_bootstrap_ci: skipped 3 unlabelled") as record:
        paired = paired_bootstrap_ci(y_mixed, p, y_mixed.clip(0), metric, n_resamples=100,
                                     random_state=0, groups=groups)
    assert len(record) == 1 and paired.n == 27


def test_bootstrap_agent_metric_drops_none():
    true = ["a", None, "b", "c"] * 5
    pred = ["a", "x", "b", "x"] * 5
    with pytest.warns(UserWarning, match="skipped 5 unlabelled") as record:
        res = bootstrap_ci(true, pred, agent_accuracy, n_resamples=50, random_state=0)
    assert len(record) == 1 and res.n == 15 and res.estimate == pytest.approx(2 / 3)


def test_online_metrics_keep_minus_one_as_a_safe_run():
    # -1 is a safe run there, not a missing label: nothing is skipped
    assert _no_warning(exact_f1, [2, -1], [2, -1]) == 1.0
    assert _no_warning(bootstrap_ci, [2, -1, 3], [2, -1, 0], exact_f1, n_resamples=20,
                       random_state=0).n == 3


class _LastTurn:
    def predict(self, X):
        return np.array([len(c) - 1 for c in X])

    def predict_agent(self, X):
        return np.array([c.speakers[-1] for c in X], dtype=object)


def test_scorers_skip_unlabelled_conversations():
    X = [Conversation([Turn("A", "x"), Turn("B", "y")], mistake_step=1),
         Conversation([Turn("A", "x"), Turn("C", "y")]),
         Conversation([Turn("A", "x"), Turn("B", "y")], mistake_step=0)]
    y = np.array([-1 if c.mistake_step is None else c.mistake_step for c in X])
    with pytest.warns(UserWarning, match="skipped 1 unlabelled"):
        assert step_accuracy_scorer(_LastTurn(), X, y) == 0.5
    with pytest.warns(UserWarning, match="skipped 1 unlabelled"):
        assert agent_accuracy_scorer()(_LastTurn(), X, y) == 0.5
