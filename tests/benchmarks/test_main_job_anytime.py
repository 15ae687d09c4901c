"""The main job's anytime estimate (:func:`skafa.benchmarks.run_main_job`): extraction in
a seeded random order, interim cross-validated estimates on the conversations extracted
so far, the running estimate on disk, Ctrl-C, and a final figure that does not change.
On a tiny random model (seconds each)."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import GridSearchCV, GroupKFold, cross_val_predict

from skafa.baselines import DummyStepClassifier
from skafa.benchmarks import MainJobSettings, main_job_table, prepare_main_job, run_main_job
from skafa.benchmarks._main_job import _interim_due, _interim_points, _outer_n_splits
from skafa.compose import make_attribution_pipeline
from skafa.configurations import make_configuration
from skafa.datasets import load_who_and_when
from skafa.featurizers import TurnPositionTransformer, TurnTextTransformer
from skafa.llm import (
    ActivationCache,
    TurnActivationTransformer,
    register_model,
    shared_memory_cache,
    unregister_model,
)
from skafa.metrics import paired_bootstrap_ci, step_accuracy
from skafa.probes import GroupedArgmaxLogisticClassifier
from skafa.testing import (
    make_conversations,
    make_tiny_llama,
    make_tiny_tokenizer,
    write_who_and_when,
)

MODEL = "main-job-anytime-tiny"
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


@pytest.fixture(scope="module", autouse=True)
def tiny_model():
    register_model(MODEL, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    yield MODEL
    unregister_model(MODEL)


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    shared_memory_cache().clear()
    yield
    shared_memory_cache().clear()


def _quickstart():
    spec = importlib.util.spec_from_file_location("skafa_example_quickstart_anytime", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_task_each(n, seed):
    """Synthetic conversations, each of its own task (make_conversations pairs them)."""
    return [dataclasses.replace(c, task_id=f"task-{i}")
            for i, c in enumerate(make_conversations(n, seed=seed))]


def _loaded(data):
    """The conversations as the main job reads them (record ids are the loader's)."""
    return list(load_who_and_when(data, subset="Algorithm-Generated",
                                  labelled=True).conversations)


def _shuffled_ids(convs, seed):
    return [convs[i].record_id for i in np.random.default_rng(seed).permutation(len(convs))]


def _old_final_cross_validation(job):
    """The final figure as the main job computed it before the anytime change (a frozen
    copy of its extraction and ``_cross_validate`` at commit 3adc4b0): every
    conversation extracted in input order, outer GroupKFold(5) by task id."""
    s, convs, y, groups = job.settings, job.conversations, job.y, job.groups
    X_all = TurnActivationTransformer(
        s.model, sites=None, read=job.read, prompt=job.template, device=s.device,
        dtype=s.dtype, cache_dir=s.cache_dir or None, batch_size=s.batch_size,
    ).fit(convs).transform(convs)
    extractor, selector = make_configuration(
        job.configuration, s.model, random_state=s.seed, prompt=job.template,
        device=s.device, dtype=s.dtype, cache_dir=s.cache_dir or None,
        batch_size=s.batch_size)
    extractor.set_params(**{"sites" if job.features == "acts" else "act__sites": job.sites})
    selector.set_params(n_jobs=s.n_jobs)
    X = X_all.select_sites(job.sites)
    outer = GroupKFold(n_splits=5)
    probe = make_attribution_pipeline(extractor, selector)
    pred = {"probe (skafa)": cross_val_predict(probe, convs, y, groups=groups, cv=outer)}
    dummies = {"always step 1": DummyStepClassifier(strategy="constant", constant=1),
               "most frequent step": DummyStepClassifier(strategy="most_frequent")}
    for name, est in dummies.items():
        pred[name] = cross_val_predict(est, X, y, groups=groups, cv=outer)
    for name, featurizer in (("position-only", TurnPositionTransformer()),
                             ("TF-IDF", TurnTextTransformer())):
        search = GridSearchCV(
            make_attribution_pipeline(featurizer, GroupedArgmaxLogisticClassifier()),
            {"groupedargmaxlogisticclassifier__C": [0.001, 0.01, 0.1]},
            cv=GroupKFold(n_splits=5), n_jobs=s.n_jobs)
        pred[name] = cross_val_predict(search, convs, y, groups=groups, cv=outer,
                                       params={"groups": groups})
    table = main_job_table(y, pred, X.speakers_at, [c.mistake_agent for c in convs], groups,
                           n_resamples=s.n_resamples, random_state=s.seed)
    boot = dict(n_resamples=s.n_resamples, random_state=s.seed, groups=groups)
    diffs = {other: paired_bootstrap_ci(y, pred["probe (skafa)"], pred[other],
                                        step_accuracy, **boot)
             for other in ("position-only", "TF-IDF", "always step 1")}
    return pred, table, diffs


# ------------------------------------------------------------------ the rules, alone
def test_outer_folds_keep_five_tasks_for_the_inner_search():
    def groups(sizes):
        return np.array([f"t{i}" for i, k in enumerate(sizes) for _ in range(k)], dtype=object)

    assert _outer_n_splits(groups([1] * 7)) == 5
    assert _outer_n_splits(groups([1] * 6)) is None  # a training part would keep 4 tasks
    assert _outer_n_splits(groups([2] * 3)) is None
    # uneven tasks: GroupKFold(5) packs the four 1-conversation tasks into one fold,
    # leaving its training part 4 tasks; 4 folds spread them
    assert _outer_n_splits(groups([4, 4, 4, 4, 1, 1, 1, 1])) == 4


def test_interim_points():
    unique = np.array([f"t{i}" for i in range(24)], dtype=object)
    order = np.random.default_rng(0).permutation(24)
    assert _interim_points(unique, order, 8, 6) == [8, 14, 20]
    assert _interim_points(unique, order, 8, 6, n_cached=10) == [10, 16, 22]  # resumed
    assert _interim_points(unique, order, 0, 6) == []  # off
    assert _interim_points(unique, order, 24, 6) == []  # the final figure comes then
    assert _interim_points(unique, order, 24, 6, n_cached=30) == []
    assert _interim_points(unique, order, 2, 6) == [7, 13, 19]  # 7 tasks for 5 folds
    pairs = np.array([f"t{i // 2}" for i in range(30)], dtype=object)
    # the first 8 in this order span 4 tasks: on until 13 conversations span 7
    assert _interim_points(pairs, np.arange(30), 8, 6) == [13, 19, 25]


def test_cadence_rule():
    # the first interim estimate is always made
    assert _interim_due(16, interim_s=0.0, extraction_s=0.0, last=None, budget=0.0)
    # the next one's cost is predicted as 10 s * 26 / 16 = 16.25 s
    kw = dict(interim_s=10.0, last=(16, 10.0), budget=0.2)
    # (10 + 16.25) / (E + 26.25) <= 0.2  <=>  E >= 105
    assert not _interim_due(26, extraction_s=104.0, **kw)
    assert _interim_due(26, extraction_s=105.0, **kw)
    assert _interim_due(26, interim_s=1e6, extraction_s=0.0, last=(16, 1e6), budget=1.0)
    assert not _interim_due(26, interim_s=0.0, extraction_s=1e9, last=(16, 1.0), budget=0.0)


def test_anytime_settings_are_checked(tmp_path):
    data = write_who_and_when(tmp_path / "wnw", make_conversations(6, seed=1))
    for field, value, match in (("anytime_first", -1, "--anytime-first"),
                                ("anytime_every", 0, "--anytime-every"),
                                ("anytime_budget", 1.5, "--anytime-budget"),
                                ("anytime_budget", float("nan"), "--anytime-budget")):
        settings = MainJobSettings(data=str(data), model=MODEL, **{field: value})
        with pytest.raises(ValueError, match=match):
            prepare_main_job(settings)
    with pytest.raises(SystemExit, match="--anytime-every"):
        _quickstart().main(["--data", str(data), "--model", MODEL, "--anytime-every", "0"])
    args = _quickstart().parse_args(["--anytime-out", str(tmp_path)])
    settings = MainJobSettings(**vars(args))
    assert (settings.anytime_first, settings.anytime_every, settings.anytime_budget,
            settings.anytime_out) == (16, 10, 0.2, str(tmp_path))


# --------------------------------------------------------------------- the main job
def test_anytime_main_job_end_to_end(tmp_path, monkeypatch):
    """Interim estimates after 8, 14, 20 of 24 conversations; the seeded order; the JSON
    and the plot; and a final figure identical to the old path's."""
    data = write_who_and_when(tmp_path / "wnw", _one_task_each(24, seed=21))
    convs = _loaded(data)
    cache = tmp_path / "cache"
    transform = TurnActivationTransformer.transform
    extraction_calls = []

    def spy(self, X):
        if self.sites is None:  # the job's extractor (the configured ones name sites)
            extraction_calls.append([c.record_id for c in X])
        return transform(self, X)

    monkeypatch.setattr(TurnActivationTransformer, "transform", spy)
    lines = []
    settings = MainJobSettings(data=str(data), model=MODEL, cache_dir=str(cache),
                               sites="stride:1", n_resamples=100, n_jobs=1, seed=3,
                               anytime_first=8, anytime_every=6, anytime_budget=1.0)
    out = run_main_job(prepare_main_job(settings, log=lines.append), log=lines.append)
    text = "\n".join(lines)
    monkeypatch.setattr(TurnActivationTransformer, "transform", transform)

    # the extraction order: the seeded shuffle, chunk by chunk, then all in input order
    shuffled = _shuffled_ids(convs, seed=3)
    assert shuffled != [c.record_id for c in convs]
    assert [len(call) for call in extraction_calls] == [8, 6, 6, 4, 24]
    assert sum(extraction_calls[:-1], []) == shuffled
    assert extraction_calls[-1] == [c.record_id for c in convs]
    assert out["anytime"]["order"] == shuffled

    # an interim estimate at each point, labelled, with an n and a CI
    heads = [line for line in lines if line.startswith("interim estimate on ")]
    assert [h.split(" of ")[0] for h in heads] == [f"interim estimate on {n}"
                                                   for n in (8, 14, 20)]
    for n, head in zip((8, 14, 20), heads):
        assert head.startswith(f"interim estimate on {n} of 24 conversations extracted so "
                               f"far ({n} tasks; the final cross-validation on them: outer "
                               "GroupKFold(5) by task id")
        i = lines.index(head)
        assert lines[i + 1].startswith("  step accuracy [95% CI]: probe (skafa) ")
        assert "| position-only " in lines[i + 1] and "| TF-IDF " in lines[i + 1]
        assert lines[i + 2].startswith("  probe - position-only: ")
        assert f"Interim, not the final figure: {24 - n} conversations to go" in lines[i + 2]
    assert "no interim estimate at" not in text  # budget 1: none skipped
    assert text.index("interim estimate on 20") < text.index("probe (skafa)        ")

    # the running estimate on disk
    folder = cache / "main-job"
    doc = json.loads((folder / "anytime.json").read_text())
    assert doc["status"] == "done" and doc["order"] == shuffled
    assert [p["n_extracted"] for p in doc["points"]] == [8, 14, 20, 24]
    assert [p["final"] for p in doc["points"]] == [False, False, False, True]
    for p in doc["points"]:
        assert p["n_splits"] == 5 and p["n_tasks"] == p["n_extracted"]
        for m in ("probe (skafa)", "position-only", "TF-IDF"):
            r = p["step_accuracy"][m]
            assert r["low"] <= r["estimate"] <= r["high"] and r["n"] == p["n_extracted"]
        d = p["probe - position-only"]
        assert d["low"] <= d["estimate"] <= d["high"]
        assert d["estimate"] == pytest.approx(p["step_accuracy"]["probe (skafa)"]["estimate"]
                                              - p["step_accuracy"]["position-only"]["estimate"])
    assert (folder / "anytime.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"{folder / 'anytime.json'} and {folder / 'anytime.png'}" in text
    assert out["anytime"]["json"] == str(folder / "anytime.json")
    final = doc["points"][-1]
    for m in ("probe (skafa)", "position-only", "TF-IDF"):
        assert final["step_accuracy"][m]["estimate"] == out["table"][m]["step"].estimate

    # the ETA printed before the run beside the time measured, in the last line
    eta = out["eta"]
    assert eta["n_extracted"] == 24 and eta["predicted_s"] > 0 and eta["measured_s"] > 0
    assert lines[-1].startswith("\nwall times: ") and "interim estimates" in lines[-1]
    assert "extraction of 24 conversations: ETA " in lines[-1]
    assert f"(measured/predicted {eta['measured_s'] / eta['predicted_s']:.2f})" in lines[-1]

    # the final figure: the old path's, on a cold extraction in input order
    shared_memory_cache().clear()
    cold = prepare_main_job(dataclasses.replace(settings, cache_dir=None))
    pred, table, diffs = _old_final_cross_validation(cold)
    assert list(out["predictions"]) == list(pred)
    for name in pred:
        np.testing.assert_array_equal(out["predictions"][name], pred[name])
        for metric in ("step", "agent", "within_1"):
            assert tuple(out["table"][name][metric]) == tuple(table[name][metric])
    for other, d in diffs.items():
        assert tuple(out["paired_all"][other]) == tuple(d)


def test_interrupt_in_the_second_chunk_says_the_last_interim_estimate(tmp_path, monkeypatch,
                                                                       capsys):
    """Ctrl-C in the second chunk: the cache stays, the last interim estimate and the
    resume hint are printed; the rerun resumes with an estimate on the cached ones."""
    data = write_who_and_when(tmp_path / "wnw", _one_task_each(20, seed=22))
    convs = _loaded(data)
    cache = tmp_path / "cache"
    out_dir = tmp_path / "anytime"
    argv = ["--data", str(data), "--model", MODEL, "--cache-dir", str(cache),
            "--sites", "stride:1", "--n-resamples", "50", "--n-jobs", "1",
            "--anytime-first", "8", "--anytime-every", "6", "--anytime-out", str(out_dir)]
    put = ActivationCache.put
    calls = []

    def put_then_interrupt(self, *args, **kwargs):
        put(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 10:  # the second of the second chunk's 6
            raise KeyboardInterrupt

    monkeypatch.setattr(ActivationCache, "put", put_then_interrupt)
    quickstart = _quickstart()
    with pytest.raises(SystemExit) as stop:
        quickstart.main([*argv, "--anytime-budget", "1"])
    assert stop.value.code == 130
    text = capsys.readouterr().out
    assert "extracting conversations 9-14 of 20 (seeded order)" in text
    stopped = text.index("\ninterrupted: 10 of 20 conversations are cached in "
                         f"{cache}; run the same command again to resume")
    after = text[stopped:]
    assert "last interim estimate (interim, not the final figure):\n" \
           "interim estimate on 8 of 20 conversations extracted so far" in after
    assert "  step accuracy [95% CI]: probe (skafa) " in after
    assert f"running estimate so far: {out_dir / 'anytime.json'}" in after
    assert "probe (skafa)        " not in text  # no final table
    assert len(list(cache.rglob("*.safetensors"))) == 10  # the cache stays
    doc = json.loads((out_dir / "anytime.json").read_text())
    assert doc["status"] == "interrupted"
    assert [p["n_extracted"] for p in doc["points"]] == [8]

    # the same command resumes: the 10 cached are read back, an interim estimate on
    # them at once; budget 0: no later one
    monkeypatch.setattr(ActivationCache, "put", put)
    shared_memory_cache().clear()
    out = quickstart.main([*argv, "--anytime-budget", "0"])
    text = capsys.readouterr().out
    assert "10 of 20 conversations to extract (10 cached)" in text
    assert "interim estimate on 10 of 20 conversations extracted so far" in text
    assert "(no interim estimate at 16 of 20: interim estimates would take more than 0%" in text
    assert "10 forward passes" in text and "10 disk hits" in text
    # the running estimate goes on: the interrupted run's estimate at 8 stays first
    assert [p["n_extracted"] for p in out["anytime"]["points"]] == [8, 10, 20]
    assert "(with 1 interim estimate(s) of an earlier run of this job" in text
    assert out["anytime"]["skipped"] == [16] and out["anytime"]["status"] == "done"
    assert out["anytime"]["order"] == _shuffled_ids(convs, seed=0)


def test_no_interim_estimates_without_anytime_first(tmp_path, monkeypatch, capsys):
    """``--anytime-first 0``: one chunk, still in the seeded order; nothing written
    without a cache dir."""
    data = write_who_and_when(tmp_path / "wnw", _one_task_each(12, seed=23))
    convs = _loaded(data)
    transform = TurnActivationTransformer.transform
    calls = []

    def spy(self, X):
        if self.sites is None:
            calls.append([c.record_id for c in X])
        return transform(self, X)

    monkeypatch.setattr(TurnActivationTransformer, "transform", spy)
    job = prepare_main_job(MainJobSettings(data=str(data), model=MODEL, cache_dir=None,
                                           sites="stride:1", n_resamples=20, n_jobs=1,
                                           anytime_first=0), log=print)
    monkeypatch.setattr("skafa.benchmarks._main_job._cross_validate",
                        lambda *a, **k: pytest.fail("stop after the extraction"))
    with pytest.raises(pytest.fail.Exception, match="stop after the extraction"):
        run_main_job(job, log=print)
    text = capsys.readouterr().out
    assert "no interim estimates (--anytime-first 0)" in text
    assert "interim estimate on" not in text and "extracting conversations" not in text
    assert calls == [_shuffled_ids(convs, seed=0), [c.record_id for c in convs]]
    assert "running estimate" not in text
