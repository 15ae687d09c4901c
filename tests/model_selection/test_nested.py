"""Tests for skafa.model_selection._nested and ._results: the nested comparison's
outer folds, inner-only choices, tables, resumable stores and the pre-registered rule."""

import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import GroupKFold

from skafa.conversation import Conversation, Turn
from skafa.features import TurnFeatures
from skafa.model_selection import (
    FoldResultStore,
    JudgeScoreStore,
    ResultStoreError,
    SiteSelector,
    make_probe,
    method_table,
    outer_splits,
    paired_differences,
    preregistered_rule,
    read_result,
    reader_rule,
    result_dtype,
    select_single_and_top,
    summarize_predictions,
    tally_rule,
)

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
SITES = [f"resid_pre.{i}" for i in range(5)]


def _sites_data(n=60, *, signal_site=3, signal=2.0, seed=0, n_sites=5):
    """Multi-site turn features with the decisive turn marked at one site."""
    rng = np.random.default_rng(seed)
    n_turns = rng.integers(3, 9, size=n)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    y = (rng.random(n) * n_turns).astype(np.int64)
    values = rng.normal(size=(offsets[-1], n_sites, 4))
    values[offsets[:-1] + y, signal_site, 0] += signal
    X = TurnFeatures(values, offsets, sites=SITES[:n_sites],
                     speakers=[f"agent{j % 3}" for j in range(offsets[-1])],
                     task_ids=[f"task{i // 3}" for i in range(n)])
    return X, y


def _conversations(y, n_turns, agents=("a", "b", "c")):
    return [Conversation([Turn(agents[j % len(agents)], f"turn {j}") for j in range(t)],
                         mistake_step=int(s), mistake_agent=agents[int(s) % len(agents)],
                         task_id=f"task{i // 3}", record_id=str(i))
            for i, (s, t) in enumerate(zip(y, n_turns))]


# ------------------------------------------------------------------ outer folds
def test_outer_splits_keep_tasks_on_one_side_and_are_reproducible():
    groups = np.repeat(np.arange(20), 3)
    y = np.zeros(60, dtype=int)
    splits = outer_splits(y, groups, n_folds=5, n_repeats=2)
    assert [(r, k) for r, k, *_ in splits] == [(r, k) for r in range(2) for k in range(5)]
    for r in range(2):
        tests = np.concatenate([te for rr, _, _, te in splits if rr == r])
        assert sorted(tests) == list(range(60))        # every record tested once per repeat
    for _, _, train, test in splits:
        assert not set(groups[train]) & set(groups[test])
    again = outer_splits(y, groups, n_folds=5, n_repeats=2)
    assert all(np.array_equal(a[3], b[3]) for a, b in zip(splits, again))
    # the shuffles differ between repeats
    assert not np.array_equal(splits[0][3], splits[5][3])
    plain = outer_splits(y, groups, n_folds=5, n_repeats=1, shuffle=False)
    ref = list(GroupKFold(5).split(np.zeros((60, 1)), y, groups))
    assert all(np.array_equal(a[3], b[1]) for a, b in zip(plain, ref))
    with pytest.raises(ValueError, match="same folds"):
        outer_splits(y, groups, n_folds=5, n_repeats=2, shuffle=False)


# ------------------------------------------------------- choices on inner folds only
def test_a_choice_cannot_leak_from_the_test_fold():
    """The signal sits at one site in the training records and at another in the test
    records: a selection that looked at the test fold would pick the test's site."""
    X, y = _sites_data(60, signal_site=1, signal=4.0, seed=1)
    Xt, yt = _sites_data(30, signal_site=4, signal=8.0, seed=2)
    groups = np.asarray(X.task_ids, dtype=object)
    got = select_single_and_top(X, y, groups, Xt, Cs=(0.1, 1.0), sites=None, inner=3,
                                n_sites=2, n_jobs=1, random_state=0, estimator="logistic")
    assert got[1][2]["sites"] == ["resid_pre.1"]
    assert "resid_pre.4" not in got[2][2]["sites"]
    assert got[1][0].shape == (30,)


def test_the_leak_check_can_fail():
    """Fitting the selection on the test records does pick their site (the check above
    would catch such a leak)."""
    Xt, yt = _sites_data(30, signal_site=4, signal=8.0, seed=2)
    groups = np.asarray(Xt.task_ids, dtype=object)
    got = select_single_and_top(Xt, yt, groups, Xt, Cs=(1.0,), sites=None, inner=3,
                                n_sites=2, n_jobs=1, random_state=0, estimator="logistic")
    assert got[1][2]["sites"] == ["resid_pre.4"]


@pytest.mark.parametrize("estimator", ["logistic", "softmax"])
def test_shared_single_and_top_equals_site_selector_param_grid(estimator):
    """The shared fit of n_sites=1 and n_sites=k is two SiteSelector(param_grid=...) fits."""
    X, y = _sites_data(60, signal=1.0, seed=3)
    groups = np.asarray(X.task_ids, dtype=object)
    train, test = np.arange(45), np.arange(45, 60)
    Xtr, Xte, ytr = X[train], X[test], y[train]
    Cs = (0.01, 0.1, 1.0)
    shared = select_single_and_top(Xtr, ytr, groups[train], Xte, Cs=Cs, sites=None, inner=3,
                                   n_sites=3, n_jobs=1, random_state=0, estimator=estimator)
    for k in (1, 3):
        sel = SiteSelector(make_probe(estimator, 1.0), cv=GroupKFold(3), n_sites=k,
                           param_grid={"C": list(Cs)}).fit(Xtr, ytr, groups=groups[train])
        pred, score, info = shared[k]
        assert info["C"] == sel.best_params_["C"]
        assert score == pytest.approx(sel.candidate_scores_[Cs.index(info["C"])])
        assert info["sites"] == list(sel.best_sites_)
        np.testing.assert_array_equal(pred, sel.predict(Xte))


@pytest.mark.parametrize("k", [1, 3])
def test_site_selector_param_grid_equals_a_loop_over_C(k):
    """SiteSelector(param_grid={"C": Cs}) is one SiteSelector per C, the best kept
    (ties: the smaller C): the selection the benchmark used to spell out by hand."""
    from sklearn.model_selection import cross_val_score

    from skafa.model_selection import SiteEnsemble

    X, y = _sites_data(60, signal=1.0, seed=3)
    groups = np.asarray(X.task_ids, dtype=object)
    Cs = (0.01, 0.1, 1.0)
    best = None
    for C in Cs:
        sel = SiteSelector(make_probe("logistic", C), cv=GroupKFold(3), n_sites=k)
        sel.fit(X, y, groups=groups)
        score = float(sel.best_score_)
        if k > 1:
            score = float(np.mean(cross_val_score(
                SiteEnsemble(make_probe("logistic", C), sites=list(sel.best_sites_)), X, y,
                groups=groups, cv=GroupKFold(3))))
        if best is None or score > best[2]:
            best = (C, sel, score)
    grid = SiteSelector(make_probe("logistic", 1.0), cv=GroupKFold(3), n_sites=k,
                        param_grid={"C": list(Cs)}).fit(X, y, groups=groups)
    assert grid.best_params_ == {"C": best[0]}
    assert grid.best_sites_ == best[1].best_sites_
    np.testing.assert_array_equal(grid.predict(X), best[1].predict(X))


# ------------------------------------------------------------------ the tables
def _toy_predictions(seed=0, n=30):
    rng = np.random.default_rng(seed)
    n_turns = rng.integers(2, 14, size=n)
    y = (rng.random(n) * n_turns).astype(int)
    good = np.where(rng.random((2, n)) < 0.6, y, 0)
    bad = np.zeros((2, n), dtype=int)
    return y, n_turns, {"good": good, "first": bad}


def test_summary_has_exact_and_lenient_step_accuracy_with_intervals():
    y, n_turns, preds = _toy_predictions()
    convs = _conversations(y, n_turns)
    groups = np.array([c.task_id for c in convs], dtype=object)
    summary, per_conv = summarize_predictions(preds, y, convs, groups, n_resamples=200)
    for name, P in preds.items():
        row = summary[name]
        exact = np.mean(P == y[None])
        assert row["step_accuracy"]["estimate"] == pytest.approx(exact)
        assert row["lenient_step_accuracy"]["estimate"] >= row["step_accuracy"]["estimate"]
        for key in ("step_accuracy", "lenient_step_accuracy", "within_1"):
            r = row[key]
            assert r["low"] <= r["estimate"] <= r["high"]
        assert row["n"] == len(y)
    # lenient counts predicted 0 for a true 10 as a miss, predicted 10 for a true 1 as a hit
    y2 = np.array([1, 10])
    convs2 = _conversations(y2, [12, 12])
    s2, _ = summarize_predictions({"m": np.array([[10, 0]])}, y2, convs2,
                                  np.array(["a", "b"], dtype=object), n_resamples=50)
    assert s2["m"]["step_accuracy"]["estimate"] == 0.0
    assert s2["m"]["lenient_step_accuracy"]["estimate"] == 0.5
    diffs = paired_differences(per_conv, [("good", "first")], groups, n_resamples=200)
    d = diffs["good - first"]
    assert d["estimate"] == pytest.approx(summary["good"]["step_accuracy"]["estimate"]
                                          - summary["first"]["step_accuracy"]["estimate"])
    lines = method_table(summary, [("", ["good", "first"])])
    assert "lenient step acc % (Who&When script)" in lines[0]
    assert lines[2].startswith("| good | ") and lines[3].startswith("| first | ")
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_method_table_reads_a_summary_written_before_the_lenient_column():
    old = read_result(RESULTS / "prereg_smollm2_Algorithm-Generated.json")["summary"]
    lines = method_table(old, [("", ["position-only"])])
    assert lines[2].startswith("| position-only | ") and lines[2].split(" | ")[2] == "-"


# ------------------------------------------------------------------ the stores
def _nested_run(store_path, y, signature, calls, stop_after=None):
    """A toy nested comparison that resumes from a FoldResultStore."""
    store = FoldResultStore(store_path, signature)
    groups = np.array([f"task{i // 3}" for i in range(len(y))], dtype=object)
    preds = {}
    for i, (r, k, train, test) in enumerate(outer_splits(y, groups, n_folds=3,
                                                         n_repeats=2)):
        if stop_after is not None and i == stop_after:
            raise KeyboardInterrupt  # the run is killed here
        store.check(r, k, len(test))
        done = store.get(r, k)
        if not done:
            calls.append((r, k))
            # "fit": predict the training part's most frequent step (a real choice)
            step = int(np.bincount(y[train]).argmax())
            done = {"mode": (np.full(len(test), step), 0.5, {"step": step})}
            store.put(r, k, done)
        for name, (pred, _, _) in done.items():
            preds.setdefault(name, np.full((2, len(y)), -1))[r, test] = pred
    return preds, groups


def test_resume_from_a_partial_store_gives_identical_tables(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, size=30)
    convs = _conversations(y, np.full(30, 6))
    sig = {"folds": 3, "records": [c.record_id for c in convs]}
    full_calls, resumed_calls = [], []
    full, groups = _nested_run(tmp_path / "full.json", y, sig, full_calls)
    with pytest.raises(KeyboardInterrupt):
        _nested_run(tmp_path / "part.json", y, sig, resumed_calls, stop_after=4)
    assert len(resumed_calls) == 4
    resumed, _ = _nested_run(tmp_path / "part.json", y, sig, resumed_calls)
    assert len(resumed_calls) == 6                       # only the two missing fits ran
    tables = []
    for preds in (full, resumed):
        summary, _ = summarize_predictions(preds, y, convs, groups, n_resamples=100)
        tables.append(method_table(summary, [("", ["mode"])]))
    assert tables[0] == tables[1]
    # the store is plain JSON, validated on read
    stored = json.loads((tmp_path / "part.json").read_text())
    assert sorted(stored["entries"]) == sorted(f"{r}|{k}" for r in range(2) for k in range(3))
    with pytest.raises(ResultStoreError, match="other settings"):
        FoldResultStore(tmp_path / "part.json", {**sig, "folds": 5})
    stored["entries"]["0|0"]["mode"]["pred"] = [0]
    (tmp_path / "part.json").write_text(json.dumps(stored))
    with pytest.raises(ResultStoreError, match=r"part\.json.*'mode' of repeat 0 fold 0"):
        _nested_run(tmp_path / "part.json", y, sig, [])
    (tmp_path / "part.json").write_text("{not json")
    with pytest.raises(ResultStoreError, match="not valid JSON"):
        FoldResultStore(tmp_path / "part.json", sig)
    (tmp_path / "part.json").write_text(json.dumps({"signature": sig, "entries": {"x": {}}}))
    with pytest.raises(ResultStoreError, match="bad entry 'x'"):
        FoldResultStore(tmp_path / "part.json", sig)


def test_fold_result_store_keeps_the_fits_another_process_stored(tmp_path):
    path, sig = tmp_path / "store.json", {"folds": 2}
    a, b = FoldResultStore(path, sig), FoldResultStore(path, sig)  # two processes
    a.put(0, 0, {"probe": (np.array([1, 2]), 0.5, {"C": 1})})
    b.put(0, 1, {"probe": (np.array([3]), 0.25, {"C": 2})})  # b opened before a wrote
    on_disk = FoldResultStore(path, sig)
    assert on_disk.get(0, 0)["probe"][0].tolist() == [1, 2]
    assert on_disk.get(0, 1)["probe"][0].tolist() == [3]
    assert a.get(0, 1) == {}
    assert a.refresh() is a and a.get(0, 1)["probe"][0].tolist() == [3]
    # a fit both hold: the file's (the latest write) wins at a refresh
    b.put(0, 0, {"probe": (np.array([0, 0]), 0.75, {"C": 3})})
    assert a.refresh().get(0, 0)["probe"][1] == 0.75
    # a damaged file is refused at the refresh, naming it
    path.write_text('{"signature": {"folds": 2}, "entries": {"x": {}}}')
    with pytest.raises(ResultStoreError, match="store.json: bad entry 'x'"):
        a.refresh()
    with pytest.raises(ResultStoreError, match="store.json: bad entry 'x'"):
        a.put(1, 0, {"probe": (np.array([1]), 0.0, {})})


def test_judge_score_store_refuses_another_conversation(tmp_path):
    store = JudgeScoreStore(tmp_path / "judge.json", {"model": "m"})
    store.put("r1", "d1", [0.1, 0.9])
    again = JudgeScoreStore(tmp_path / "judge.json", {"model": "m"})
    np.testing.assert_array_equal(again.get("r1", "d1", 2), [0.1, 0.9])
    assert again.get("r2", "d2", 3) is None
    with pytest.raises(ResultStoreError, match="judge scores of r1"):
        again.get("r1", "other", 2)
    with pytest.raises(ResultStoreError, match="other settings"):
        JudgeScoreStore(tmp_path / "judge.json", {"model": "n"})


def test_every_committed_result_file_is_readable():
    """The committed results are history: the reader reads every one of them."""
    paths = [p for p in sorted(RESULTS.glob("*.json"))
             if ".partial-" not in p.name and "summary" in json.loads(p.read_text())]
    assert len(paths) >= 19
    for path in paths:
        result = read_result(path)
        assert result["summary"]
    for path in sorted(RESULTS.glob("*.partial-*.json")):
        stored = json.loads(path.read_text())
        if path.name.endswith("-grafted_judge-scores.json"):
            # the grafted judge's own store: validated by its reader (baselines tests)
            assert stored["format"] == "skafa.grafted-split-store" and stored["stats"]
            continue
        if path.name.endswith("-locator_heads.json"):  # §8's per-head heatmap summary
            from skafa.benchmarks._locators import _read_locator_heads

            assert _read_locator_heads(path, stored["signature"])["accuracy"]
            continue
        store_cls = (JudgeScoreStore if path.name.endswith(("-judge.json", "-judge-scores.json"))
                     else FoldResultStore)
        store = store_cls(path, stored["signature"])   # validated, same signature
        assert store.entries


def test_read_result_refuses_a_damaged_file(tmp_path):
    good = json.loads((RESULTS / "prereg_smollm2_Algorithm-Generated.json").read_text())
    path = tmp_path / "r.json"
    bad = json.loads(json.dumps(good))
    bad["predictions"]["TF-IDF"][0] = bad["predictions"]["TF-IDF"][0][:-1]
    path.write_text(json.dumps(bad))
    with pytest.raises(ResultStoreError, match="predictions of 'TF-IDF'"):
        read_result(path)
    bad = json.loads(json.dumps(good))
    bad["summary"]["TF-IDF"]["step_accuracy"]["estimate"] = 3.0
    path.write_text(json.dumps(bad))
    with pytest.raises(ResultStoreError, match="step accuracy of 'TF-IDF'"):
        read_result(path)
    path.write_text(json.dumps({"entries": {}}))
    with pytest.raises(ResultStoreError, match="not a comparison result"):
        read_result(path)
    assert result_dtype(good) == "float32"


# -------------------------------------------------------- the pre-registered rule
def test_rule_step_one_picks_the_highest_inner_score_ties_by_order():
    order = ["last: a", "last: b", "recap: a"]
    fold = {"last: a": (np.array([1]), 0.40, {}), "last: b": (np.array([2]), 0.55, {}),
            "recap: a": (np.array([3]), 0.55, {}), "TF-IDF": (np.array([4]), 0.99, {})}
    pred, score, info = preregistered_rule(fold, order)
    assert info == {"chosen": "last: b", "inner_score": 0.55} and score is None
    np.testing.assert_array_equal(pred, [2])
    assert preregistered_rule(fold, order[::-1])[2]["chosen"] == "recap: a"
    with pytest.raises(ValueError, match="no configuration"):
        preregistered_rule({"TF-IDF": fold["TF-IDF"]}, order)


def test_rule_step_two_tallies_complete_cells():
    order = ["last: a", "last: b", "recap: a"]

    def cell(tag, choices, deviations=(), subset="Algorithm-Generated"):
        return tag, {"preregistered": True, "tag": tag, "subset": subset, "order": order,
                     "auto_choices": choices, "deviations": list(deviations)}

    out = tally_rule([cell("m1", {"last: b": 3, "recap: a": 2}),
                      cell("m2", {"recap: a": 1, "last: a": 4}),
                      cell("m3", {"last: a": 15}, ["reads echo not run"]),
                      cell("m4", {"last: a": 15}, subset="Hand-Crafted")])
    assert out["tally"] == {"last: b": 3, "recap: a": 3, "last: a": 4}
    assert out["winner"] == "last: a"
    assert [why for _, why in out["left_out"]] == ["reads echo not run", "not Algorithm-Generated"]
    tie = tally_rule([cell("m1", {"last: b": 3, "recap: a": 3})])
    assert tie["winner"] == "last: b"                    # ties: the pre-registered order
    assert tally_rule([cell("m3", {"last: a": 1}, ["x"])])["winner"] is None
    with pytest.raises(ValueError, match="not a pre-registered result"):
        tally_rule([("x", {"summary": {}})])


def test_rule_on_the_committed_cells_picks_the_documented_default():
    from skafa.configurations import RECOMMENDED

    paths = sorted(RESULTS.glob("prereg_*_Algorithm-Generated.json"))
    out = tally_rule([(p, read_result(p)) for p in paths])
    assert out["winner"] == RECOMMENDED
    assert len(out["complete"]) + len(out["left_out"]) == len(paths)


def test_reader_rule_recommends_only_when_the_headline_beats_position():
    """Section 7's rule step 2: most chosen configuration, only with a paired CI above 0."""
    order = ["last: a", "last: b", "echo: a"]

    def cell(low, choices, deviations=("model in bfloat16 instead of float32 (...)",),
             dtype="bfloat16", subset="Algorithm-Generated"):
        return {"preregistered": True, "tag": "m", "subset": subset, "order": order,
                "dtype": dtype, "auto_choices": choices, "choice_deviations": list(deviations),
                "paired": {"skafa (pre-registered auto) - position-only":
                           {"estimate": low + 0.05, "low": low, "high": low + 0.1}}}

    out = reader_rule(cell(0.01, {"last: b": 6, "echo: a": 9}))
    assert out["winner"] == out["most_chosen"] == "echo: a" and out["tally"]["last: b"] == 6
    assert reader_rule(cell(0.01, {"last: b": 5, "echo: a": 5}))["winner"] == "last: b"  # order
    no = reader_rule(cell(-0.01, {"echo: a": 15}))
    assert no["winner"] is None and no["most_chosen"] == "echo: a"
    assert reader_rule(cell(0.02, {"last: a": 15}, deviations=(), dtype="float32"))["winner"]
    with pytest.raises(ValueError, match="reads echo not run"):
        reader_rule(cell(0.01, {"last: a": 15}, deviations=("reads echo not run",)))
    with pytest.raises(ValueError, match="deviations"):   # another dtype than the file's own
        reader_rule(cell(0.01, {"last: a": 15}, dtype="float16"))
    with pytest.raises(ValueError, match="Algorithm-Generated"):
        reader_rule(cell(0.01, {"last: a": 15}, subset="Hand-Crafted"))
    bad = cell(0.01, {"last: a": 15})
    bad["paired"] = {}
    with pytest.raises(ValueError, match="no paired difference"):
        reader_rule(bad)
    with pytest.raises(ValueError, match=r"\['middle: a'\] not in"):  # a hostile file
        reader_rule(cell(0.01, {"middle: a": 15}))
    with pytest.raises(ValueError, match="no auto_choices"):
        reader_rule({**cell(0.01, {}), "auto_choices": None})


def test_reader_rule_on_the_committed_cells_gives_the_documented_reader_defaults():
    """RECOMMENDED_FOR_READER holds what section 7's rule gives on the committed files,
    and only for readers whose cell beat position-only."""
    from skafa.configurations import RECOMMENDED_FOR_READER

    got = {}
    for path in sorted(RESULTS.glob("prereg_*_Algorithm-Generated.json")):
        result = read_result(path)
        if result.get("tag") in RECOMMENDED_FOR_READER:
            got[result["tag"]] = reader_rule(result)["winner"]
    assert got == RECOMMENDED_FOR_READER
