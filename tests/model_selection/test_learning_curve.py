"""grouped_learning_curve: runs drawn by task groups, every run scored once per draw."""

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from skafa import GroupedArgmaxLogisticClassifier, TurnFeatures  # noqa: E402
from skafa.baselines import DummyStepClassifier  # noqa: E402
from skafa.model_selection import LearningCurveResult, grouped_learning_curve  # noqa: E402
from skafa.model_selection._learning_curve import _draw_by_groups  # noqa: E402
from skafa.testing import make_site_features  # noqa: E402


def _data(n=30, seed=0, signal=4.0):
    return make_site_features(n=n, n_sites=1, signal_site=0, signal=signal, seed=seed)


def test_shapes_and_every_run_scored_once_per_draw():
    X, y = _data()
    res = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y,
                                 train_sizes=[3, 7, 1.0], n_draws=3, random_state=0)
    assert isinstance(res, LearningCurveResult)
    assert res.hits.shape == (3, 3, 30)
    assert np.isin(res.hits, [0.0, 1.0]).all()
    # k runs per fit (fold training parts hold 24 runs: 10 tasks of 3 -> 8 tasks)
    assert (res.n_labelled[0] == 3).all() and (res.n_labelled[1] == 7).all()
    assert (res.n_labelled[2] == 24).all()
    assert res.draw_scores.shape == (3, 3)


def test_k0_without_source_is_nan_and_with_source_is_transfer():
    X, y = _data()
    Xs, ys = _data(n=60, seed=1)
    res = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y,
                                 train_sizes=[0, 1.0], n_draws=2, random_state=0)
    assert np.isnan(res.hits[0]).all() and np.isfinite(res.hits[1]).all()
    rows = res.summary(n_resamples=50)
    assert np.isnan(rows[0]["mean"]) and np.isfinite(rows[1]["mean"])
    pooled = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y,
                                    train_sizes=[0], n_draws=2, random_state=0,
                                    X_source=Xs, y_source=ys)
    assert pooled.pooled and np.isfinite(pooled.hits).all()
    # the source carries the same signal, so transfer alone is far above chance
    assert pooled.hits.mean() > 0.6
    assert (pooled.n_labelled == 0).all()


def test_a_source_that_disagrees_transfers_badly_and_target_labels_do_not():
    """A source whose signal points the other way: transfer is poor, target-only fine."""
    X, y = _data(n=45, signal=4.0)
    Xs, ys = _data(n=45, seed=3, signal=-4.0)
    pooled = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y,
                                    train_sizes=[0], n_draws=2, random_state=0,
                                    X_source=Xs, y_source=ys)
    own = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y,
                                 train_sizes=[1.0], n_draws=2, random_state=0)
    assert pooled.hits.mean() < 0.2 < own.hits.mean()


def test_draws_are_by_task_groups_and_reproducible():
    groups = np.asarray([f"t{i // 3}" for i in range(30)], dtype=object)
    pool = np.arange(30)
    rng = np.random.RandomState(0)
    picked = _draw_by_groups(pool, groups, 7, rng)
    assert picked.size == 7
    tasks, counts = np.unique(groups[picked], return_counts=True)
    # whole tasks, the last one trimmed: at most one task is incomplete
    assert (counts < 3).sum() <= 1 and tasks.size == 3
    X, y = _data()
    a = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y, train_sizes=[5],
                               n_draws=2, random_state=4)
    b = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y, train_sizes=[5],
                               n_draws=2, random_state=4)
    np.testing.assert_array_equal(a.hits, b.hits)


def test_summary_ci_and_spread():
    X, y = _data(signal=1.0)
    res = grouped_learning_curve(DummyStepClassifier(strategy="most_frequent"), X, y,
                                 train_sizes=[10, 1.0], n_draws=5, random_state=0)
    for row in res.summary(n_resamples=200, random_state=0):
        assert row["low"] <= row["mean"] <= row["high"]
        assert row["spread_low"] <= row["spread_high"]
        assert row["n_draws"] == 5 and row["n"] == 30
    with pytest.raises(ValueError, match="n_resamples"):
        res.summary(n_resamples=0)


def test_works_on_conversations_through_a_pipeline():
    from skafa import TurnPositionTransformer, make_attribution_pipeline
    from skafa.testing import make_conversations

    convs = make_conversations(20, seed=0)
    y = [c.mistake_step for c in convs]
    pipe = make_attribution_pipeline(TurnPositionTransformer(),
                                     GroupedArgmaxLogisticClassifier())
    res = grouped_learning_curve(pipe, convs, y, groups=np.arange(20), train_sizes=[4],
                                 n_draws=2, n_splits=4, random_state=0)
    assert np.isfinite(res.hits).all()


def test_plot(tmp_path):
    X, y = _data()
    res = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y,
                                 train_sizes=[5, 1.0], n_draws=2, random_state=0)
    ax = res.plot(label="target-only", n_resamples=50)
    ax.figure.savefig(tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert ax.get_xlabel() == "labelled target runs (k)"


def test_errors_name_the_problem():
    X, y = _data()
    est = GroupedArgmaxLogisticClassifier()
    with pytest.raises(ValueError, match="y has shape"):
        grouped_learning_curve(est, X, y[:-1])
    no_ids = TurnFeatures(X.values, X.offsets)
    with pytest.raises(ValueError, match="30 conversation.*no task id"):
        grouped_learning_curve(est, no_ids, y)
    with pytest.raises(ValueError, match="n_splits=20 needs"):
        grouped_learning_curve(est, X, y, n_splits=20)
    with pytest.raises(ValueError, match="share of the training"):
        grouped_learning_curve(est, X, y, train_sizes=[1.5])
    with pytest.raises(ValueError, match="without y_source"):
        grouped_learning_curve(est, X, y, X_source=X)
    with pytest.raises(ValueError, match="n_draws"):
        grouped_learning_curve(est, X, y, n_draws=0)


def test_label_order_takes_the_lowest_of_each_training_part():
    X, y = _data()
    order = np.arange(30, dtype=float)[::-1]  # the last runs first
    res = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y, train_sizes=[4],
                                 n_draws=1, random_state=0, label_order=order)
    assert (res.n_labelled == 4).all() and np.isfinite(res.hits).all()

    from sklearn.base import BaseEstimator

    seen = []

    class Spy(BaseEstimator):
        def fit(self, X, y):
            seen.append(X.n_turns.tolist())
            return self

        def predict(self, X):
            return np.zeros(X.n_conversations, dtype=int)

    grouped_learning_curve(Spy(), X, y, train_sizes=[4], n_draws=1, random_state=0,
                           label_order=order)
    folds = list(__import__("sklearn.model_selection", fromlist=["GroupKFold"]).GroupKFold(
        5, shuffle=True, random_state=int(np.random.RandomState(0).randint(
            np.iinfo(np.int32).max, size=1)[0])).split(np.zeros(30), y, X.task_ids))
    for (train, _), fitted in zip(folds, seen):
        expected = np.sort(train[np.argsort(order[train])[:4]])
        assert fitted == X.n_turns[expected].tolist()
    with pytest.raises(ValueError, match="label_order must hold 30"):
        grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y, train_sizes=[4],
                               label_order=order[:-1])


def test_n_jobs_does_not_change_the_result():
    X, y = _data()
    kw = dict(train_sizes=[5, 1.0], n_draws=2, random_state=3)
    a = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y, **kw)
    b = grouped_learning_curve(GroupedArgmaxLogisticClassifier(), X, y, n_jobs=2, **kw)
    np.testing.assert_array_equal(a.hits, b.hits)
    np.testing.assert_array_equal(a.n_labelled, b.n_labelled)
