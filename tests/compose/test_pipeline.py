import pickle

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold, cross_val_predict
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils import estimator_html_repr

from skafa import (
    AttributionPipeline,
    DummyStepClassifier,
    GroupedArgmaxLogisticClassifier,
    PerTurn,
    TurnPositionTransformer,
    make_attribution_pipeline,
)
from skafa.compose import final_step_call
from skafa.testing import make_conversations


@pytest.fixture(scope="module")
def data():
    convs = make_conversations(30, min_turns=3, max_turns=6, seed=1)
    y = np.array([c.mistake_step for c in convs])
    groups = np.array([c.task_id for c in convs])
    return convs, y, groups


def _pipe():
    return AttributionPipeline([("pos", TurnPositionTransformer()),
                                ("scale", PerTurn(StandardScaler())),
                                ("probe", GroupedArgmaxLogisticClassifier(C=0.1))])


def test_delegates_skafa_methods_like_manual_transform(data):
    convs, y, _ = data
    pipe = _pipe().fit(convs, y)
    Xt = pipe[:-1].transform(convs)
    probe = pipe[-1]
    np.testing.assert_array_equal(pipe.predict_agent(convs), probe.predict_agent(Xt))
    for method in ("turn_decision_function", "turn_predict_proba"):
        ours, ref = getattr(pipe, method)(convs), getattr(probe, method)(Xt)
        assert len(ours) == len(convs)
        for a, b in zip(ours, ref):
            np.testing.assert_array_equal(a, b)
    # predict_agent is the speaker of the predicted turn
    pred = pipe.predict(convs)
    assert list(pipe.predict_agent(convs)) == [c.speakers[s] for c, s in zip(convs, pred)]


def test_plain_pipeline_lacks_methods_and_helper_covers_it(data):
    convs, y, _ = data
    plain = Pipeline([("pos", TurnPositionTransformer()),
                      ("probe", GroupedArgmaxLogisticClassifier())]).fit(convs, y)
    assert not hasattr(plain, "predict_agent")
    ours = AttributionPipeline(plain.steps)
    np.testing.assert_array_equal(final_step_call(plain, "predict_agent", convs),
                                  ours.predict_agent(convs))
    # a bare estimator goes straight through
    est = DummyStepClassifier(strategy="first").fit(convs, y)
    assert list(final_step_call(est, "predict", convs)) == [0] * len(convs)


def test_methods_hidden_when_final_step_lacks_them(data):
    convs, y, _ = data
    pipe = AttributionPipeline([("pos", TurnPositionTransformer())]).fit(convs, y)
    assert not hasattr(pipe, "predict_agent")
    assert not hasattr(pipe, "turn_predict_proba")


def test_sklearn_composition(data):
    convs, y, groups = data
    pipe = make_attribution_pipeline(TurnPositionTransformer(),
                                     GroupedArgmaxLogisticClassifier())
    assert [n for n, _ in pipe.steps] == ["turnpositiontransformer",
                                         "groupedargmaxlogisticclassifier"]
    gs = GridSearchCV(pipe, {"groupedargmaxlogisticclassifier__C": [0.01, 1.0]},
                      cv=GroupKFold(3)).fit(convs, y, groups=groups)
    assert isinstance(gs.best_estimator_, AttributionPipeline)
    assert len(gs.best_estimator_.predict_agent(convs)) == len(convs)
    pred = cross_val_predict(pipe, convs, y, groups=groups, cv=GroupKFold(3))
    assert pred.shape == y.shape
    fitted = clone(pipe).fit(convs, y)
    again = pickle.loads(pickle.dumps(fitted))
    np.testing.assert_array_equal(again.predict(convs), fitted.predict(convs))
    assert "AttributionPipeline" in estimator_html_repr(pipe)
