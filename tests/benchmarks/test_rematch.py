"""The §7 rematch candidates C28 / C29 on two tiny random readers and two synthetic subsets."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import GroupKFold

import skafa.benchmarks._rematch as rematch
from skafa import TurnFeatures
from skafa.benchmarks import (
    AUTO,
    REMATCH_CANDIDATES,
    BenchmarkSettings,
    RematchSettings,
    run_benchmark,
    run_rematch_candidates,
)
from skafa.compose import make_attribution_pipeline
from skafa.configurations import RECOMMENDED, make_configuration
from skafa.llm import PromptTemplate, register_model
from skafa.model_selection import ResultStoreError, TurnScoreStacker, outer_splits
from skafa.probes import GroupedSoftmaxClassifier
from skafa.testing import (
    make_conversations,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
AG, HC = "Algorithm-Generated", "Hand-Crafted"
LLAMA, QWEN = "rematch-test-llama", "rematch-test-qwen"
BUDGETS = {AG: 512, HC: 384}  # the tiny models' context is 512 tokens
C28, C29 = REMATCH_CANDIDATES["C28"], REMATCH_CANDIDATES["C29"]


def _conversations():
    hc = [dataclasses.replace(c, task_id=f"hc-{c.task_id}", record_id=f"hc/{c.record_id}")
          for c in make_conversations(16, seed=1)]
    return {AG: make_conversations(20, seed=0), HC: hc}


def _settings(root, **changes):
    base = RematchSettings(reader=QWEN, ensemble_readers=[LLAMA, QWEN],
                           max_prompt_tokens=dict(BUDGETS), folds=2, inner_folds=2,
                           repeats=1, n_resamples=100, smoke=True, dtype="float32",
                           cache_dir=str(root / "cache"), out=str(root / "out"))
    return dataclasses.replace(base, **changes)


def _headline(root, convs):
    """The headline's §3/§7 file of each subset, written by the §3 runner (smoke)."""
    for subset, cs in convs.items():
        run_benchmark(BenchmarkSettings(
            model=QWEN, preregistered=True, reads=["last"], no_stack=True, no_mi4afa=True,
            sites="stride:3", folds=2, inner_folds=2, repeats=1, Cs=[0.1], n_resamples=100,
            max_prompt_tokens=BUDGETS[subset], dtype="float32", smoke=True, peer_n=0,
            cache_dir=str(root / "cache"), out=str(root / "prereg")), cs,
            subset_label=subset)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    register_model(LLAMA, make_tiny_llama(n_layers=7), make_tiny_tokenizer(), overwrite=True)
    register_model(QWEN, make_tiny_qwen2(n_layers=7), make_tiny_tokenizer(), overwrite=True)
    root = tmp_path_factory.mktemp("rematch")
    convs = _conversations()
    _headline(root, convs)
    settings = _settings(root, prereg_dir=str(root / "prereg"))
    return root, convs, settings, run_rematch_candidates(settings, convs)


def _extract(root, reader, subset, convs):
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=BUDGETS[subset])
    ext, sel = make_configuration(RECOMMENDED, reader, prompt=template, dtype="float32",
                                  cache_dir=str(root / "cache"))
    return ext, sel.set_params(cv=GroupKFold(2))


def _y_groups(cs):
    return (np.array([c.mistake_step for c in cs]),
            np.array([c.task_id for c in cs], dtype=object))


def test_c29_is_one_selector_fitted_on_the_union_of_the_training_parts(run):
    root, convs, _, result = run
    A, splits, sel = {}, {}, None
    for s, cs in convs.items():
        ext, sel = _extract(root, QWEN, s, cs)
        A[s] = ext.fit_transform(cs)
        splits[s] = outer_splits(*_y_groups(cs), n_folds=2, n_repeats=1)
        assert result["subsets"][s]["readers"][QWEN]["budget"] == BUDGETS[s]
    for f in range(2):
        parts = {s: splits[s][f][2:] for s in convs}
        ys = {s: _y_groups(convs[s]) for s in convs}
        X = TurnFeatures.vstack([A[s][parts[s][0]] for s in convs])
        fitted = sel.fit(X, np.concatenate([ys[s][0][parts[s][0]] for s in convs]),
                         groups=np.concatenate([ys[s][1][parts[s][0]] for s in convs]))
        for s in convs:
            got = np.asarray(result["subsets"][s]["predictions"][C29])[0, parts[s][1]]
            np.testing.assert_array_equal(got, fitted.predict(A[s][parts[s][1]]))
            choice = result["subsets"][s]["choices"][C29][f]
            assert choice["sites"] == list(fitted.best_sites_)
            assert choice["n_train"] == {t: len(parts[t][0]) for t in convs}
            assert choice["n_excluded"] == {t: 0 for t in convs}  # disjoint task ids


def test_c28_is_a_turn_score_stacker_of_the_readers(run):
    root, convs, _, result = run
    s = HC
    cs = convs[s]
    y, groups = _y_groups(cs)
    for f, (_, _, train, test) in enumerate(outer_splits(y, groups, n_folds=2, n_repeats=1)):
        stack = TurnScoreStacker(
            [(name, make_attribution_pipeline(*_extract(root, name, s, cs)))
             for name in (LLAMA, QWEN)],
            final_estimator=GroupedSoftmaxClassifier(C=1.0), cv=GroupKFold(2))
        stack.fit([cs[i] for i in train], y[train], groups=groups[train])
        got = np.asarray(result["subsets"][s]["predictions"][C28])[0, test]
        np.testing.assert_array_equal(got, stack.predict([cs[i] for i in test]))
        weights = result["subsets"][s]["choices"][C28][f]["weights"]
        np.testing.assert_allclose(list(weights.values()),
                                   np.ravel(stack.final_estimator_.coef_))


def test_paired_differences_against_the_headline_file(run):
    root, convs, _, result = run
    for s, cs in convs.items():
        entry = result["subsets"][s]
        assert entry["headline"]["present"]
        headline = json.loads((root / "prereg" / f"prereg_smoke_{s}.json").read_text())
        y = np.array(headline["y_true"])
        assert headline["record_ids"] == [c.record_id for c in cs]
        for row in (C28, C29):
            for other in (AUTO, "position-only", "TF-IDF", "dummy: most_frequent",
                          "PromptedJudge (logprob)"):
                d = entry["paired"][f"{row} - {other}"]
                P = np.asarray(entry["predictions"][row])
                Q = np.asarray(headline["predictions"][other])
                assert d["estimate"] == pytest.approx(np.mean(P == y) - np.mean(Q == y))
                assert d["low"] <= d["estimate"] <= d["high"]
        # the fixed configurations of the file are not baselines
        assert not any(k.startswith("last: ") for k in entry["summary"])
        assert entry["summary"][C28]["lenient_step_accuracy"]["estimate"] >= \
            entry["summary"][C28]["step_accuracy"]["estimate"]
    for cand, row in REMATCH_CANDIDATES.items():
        verdict = result["rule_step_3"][cand]
        lows = [result["subsets"][s]["paired"][f"{row} - {AUTO}"]["low"] for s in (AG, HC)]
        assert verdict["replaces"] is all(low > 0 for low in lows)
        assert "not decided" not in verdict["reason"]
    md = (root / "out" / "rematch_smoke.md").read_text()
    assert f"| {C28} - {AUTO} |" in md and "## Rule step 3" in md
    saved = json.loads((root / "out" / "rematch_smoke.json").read_text())
    assert saved["subsets"][AG]["predictions"] == result["subsets"][AG]["predictions"]


def _hostile(root, convs, settings, tmp_path, edit):
    folder = tmp_path / "hostile"
    folder.mkdir(exist_ok=True)
    for s in convs:
        data = json.loads((root / "prereg" / f"prereg_smoke_{s}.json").read_text())
        if s == AG:
            edit(data)
        (folder / f"prereg_smoke_{s}.json").write_text(json.dumps(data))
    bad = dataclasses.replace(settings, prereg_dir=str(folder), out=str(tmp_path / "o"))
    return bad


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["record_ids"].__setitem__(0, "other/0"), "'record_ids' differs at conv"),
    (lambda d: d["y_true"].pop(), "'y_true' has 19 entries, this run 20"),
    (lambda d: d["task_ids"].__setitem__(3, 7), "'task_ids' is not a list of strings"),
    (lambda d: d.__setitem__("repeats", 3), "repeats is 3, this run 1"),
    (lambda d: d["predictions"].__setitem__(AUTO, "no"), "are not 1 lists of 20 ints"),
    (lambda d: d["predictions"]["TF-IDF"][0].__setitem__(2, True), "are not 1 lists"),
    (lambda d: d["predictions"]["TF-IDF"][0].__setitem__(2, 99), "name step 99 of conv"),
    (lambda d: d["predictions"].pop(AUTO), "no 'skafa \\(pre-registered auto\\)' row"),
    (lambda d: d.clear(), "'record_ids' is not a list"),
])
def test_a_mismatched_or_hostile_headline_is_refused_before_any_fit(run, tmp_path,
                                                                     monkeypatch, edit, message):
    root, convs, settings, _ = run
    bad = _hostile(root, convs, settings, tmp_path, edit)

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted before the headline was checked")

    monkeypatch.setattr(rematch, "_open_reading", no_fit)
    with pytest.raises(ResultStoreError, match=f"prereg_smoke_{AG}.json: .*{message}"):
        run_rematch_candidates(bad, convs)


def test_not_json_headline_is_refused(run, tmp_path):
    root, convs, settings, _ = run
    (tmp_path / f"prereg_smoke_{AG}.json").write_text("[1, 2")
    with pytest.raises(ResultStoreError, match="not valid JSON"):
        run_rematch_candidates(dataclasses.replace(settings, prereg_dir=str(tmp_path)), convs)


def test_resume_after_an_interruption_equals_the_uninterrupted_run(run, tmp_path,
                                                                   monkeypatch):
    root, convs, settings, full = run
    resumed = dataclasses.replace(settings, out=str(tmp_path / "out"), resume=True)
    calls = []
    fit = rematch._fit_c28

    def interrupted(*args, **kwargs):
        if calls:
            raise KeyboardInterrupt("killed")
        calls.append(1)
        return fit(*args, **kwargs)

    monkeypatch.setattr(rematch, "_fit_c28", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_rematch_candidates(resumed, convs)
    store = json.loads((tmp_path / "out" / f"rematch_smoke_{AG}.partial-C28.json").read_text())
    assert list(store["entries"]) == ["0|0"]
    monkeypatch.setattr(rematch, "_fit_c28", fit)
    again = run_rematch_candidates(resumed, convs)
    assert again["resumed"]["fits_reused"] == {f"C28 {AG}": 1}
    for s in convs:
        assert again["subsets"][s]["predictions"] == full["subsets"][s]["predictions"]
        assert again["subsets"][s]["paired"] == full["subsets"][s]["paired"]
        assert again["subsets"][s]["choices"] == json.loads(
            json.dumps(full["subsets"][s]["choices"]))
    assert again["rule_step_3"] == full["rule_step_3"]
    # a third run reuses every fit
    third = run_rematch_candidates(resumed, convs)
    assert third["resumed"]["fits_reused"] == {f"{c} {s}": 2 for c in ("C28", "C29")
                                               for s in (AG, HC)}
    # a store written with another prompt budget is refused
    other = dataclasses.replace(resumed, max_prompt_tokens={AG: 512, HC: 320})
    with pytest.raises(ResultStoreError, match="written with other settings"):
        run_rematch_candidates(other, convs)


def test_c29_leaves_out_training_records_whose_task_is_tested_in_the_other_subset(
        run, tmp_path):
    root, convs, _, _ = run
    # the Hand-Crafted records take Algorithm-Generated's task ids: task-0... in both
    shared = {AG: convs[AG], HC: make_conversations(16, seed=1)}
    settings = _settings(root, candidates=["C29"], out=str(tmp_path / "out"),
                         prereg_dir=str(tmp_path / "none"))
    result = run_rematch_candidates(settings, shared)
    ys = {s: _y_groups(cs) for s, cs in shared.items()}
    splits = {s: outer_splits(*ys[s], n_folds=2, n_repeats=1) for s in shared}
    A, sel = {}, None
    for s, cs in shared.items():
        ext, sel = _extract(root, QWEN, s, cs)
        A[s] = ext.fit_transform(cs)
    n_out = 0
    for f in range(2):
        held = {g for s in shared for g in ys[s][1][splits[s][f][3]]}
        train = {s: [i for i in splits[s][f][2] if ys[s][1][i] not in held] for s in shared}
        excluded = {s: len(splits[s][f][2]) - len(train[s]) for s in shared}
        n_out += sum(excluded.values())
        fitted = sel.fit(TurnFeatures.vstack([A[s][train[s]] for s in shared]),
                         np.concatenate([ys[s][0][train[s]] for s in shared]),
                         groups=np.concatenate([ys[s][1][train[s]] for s in shared]))
        for s in shared:
            got = np.asarray(result["subsets"][s]["predictions"][C29])[0, splits[s][f][3]]
            np.testing.assert_array_equal(got, fitted.predict(A[s][splits[s][f][3]]))
            choice = result["subsets"][s]["choices"][C29][f]
            assert choice["n_excluded"] == excluded
            assert choice["n_train"] == {t: len(train[t]) for t in shared}
    assert n_out > 0  # the shared tasks did sit on both sides: the test can fail


def test_settings_are_checked():
    convs = _conversations()
    with pytest.raises(ValueError, match="needs at least two"):
        run_rematch_candidates(RematchSettings(subsets=[AG], candidates=["C29"]), convs)
    with pytest.raises(ValueError, match="no conversations given for subsets"):
        run_rematch_candidates(RematchSettings(), {AG: convs[AG]})
    with pytest.raises(ValueError, match="C28 needs distinct readers"):
        run_rematch_candidates(RematchSettings(ensemble_readers=["a", "a"]), convs)


def test_benchmark_rematch_cli_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("benchmark_rematch",
                                                  EXAMPLES / "benchmark_rematch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--smoke", "--out", str(tmp_path / "out"),
                         "--cache-dir", str(tmp_path / "cache")])
    saved = json.loads((tmp_path / "out" / "rematch_smoke.json").read_text())
    assert saved["tag"] == "smoke" and set(saved["subsets"]) == {AG, HC}
    for s, n in ((AG, 20), (HC, 16)):
        for row in (C28, C29):
            P = np.asarray(saved["subsets"][s]["predictions"][row])
            assert P.shape == (1, n) and P.min() >= 0
        assert saved["subsets"][s]["headline"]["present"] is False
        assert saved["subsets"][s]["paired"] == {}
    assert result["rule_step_3"]["C28"]["replaces"] is None
    md = (tmp_path / "out" / "rematch_smoke.md").read_text()
    assert "headline not run: no paired differences" in md and "not decided" in md
