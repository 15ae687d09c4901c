"""The §8 locator-head / grafting benchmark runs end to end on the tiny random model."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import skafa.benchmarks._locators as locators
from skafa import TurnFeatures
from skafa.benchmarks import LOCATOR_ROWS, gap_closed, top_locator_head
from skafa.llm import shared_memory_cache
from skafa.model_selection import FoldResultStore, ResultStoreError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_locators_smoke(tmp_path):
    bench = _load("benchmark_locators")
    out = tmp_path / "out"
    result = bench.main(["--smoke", "--out", str(out), "--cache-dir", str(tmp_path / "c")])
    assert result["rows"] == list(LOCATOR_ROWS) and result["missing_rows"] == []
    saved = json.loads((out / "locators_smoke_Algorithm-Generated.json").read_text())
    assert saved["predictions"] == result["predictions"] and saved["n"] == 20
    for name in LOCATOR_ROWS:
        P = np.asarray(result["predictions"][name])
        assert P.shape == (1, 20) and P.min() >= 0, name
        r = result["summary"][name]["step_accuracy"]
        assert 0.0 <= r["low"] <= r["estimate"] <= r["high"] <= 1.0, name
    assert {"grafted_judge - judge", "locator_probe - position"} <= set(result["paired"])
    md = (out / "locators_smoke_Algorithm-Generated.md").read_text()
    assert "| locator_probe |" in md and "× one bare forward pass" in md
    assert all(v >= 0 for v in result["cost_vs_bare_forward"].values())
    assert saved["bare_forward_s"] > 0 and "attention priced apart" in md
    heads = saved["locator_heads"]  # the per-head heatmap: descriptive, every record
    acc = np.asarray(heads["accuracy"])
    assert acc.shape == (len(heads["sites"]), acc.shape[1]) and 0 <= acc.min() <= acc.max() <= 1
    site, head, best = heads["top"][0]
    assert best == acc.max() and acc[heads["sites"].index(site), head] == best
    assert (out / heads["figure"]).stat().st_size > 0 and heads["figure"] in md


def test_locator_heads_summary_ranks_heads_on_every_record():
    rng = np.random.default_rng(1)
    offsets = np.array([0, 3, 7, 10])
    y = np.array([2, 0, 1])
    values = rng.uniform(0, 0.2, size=(10, 2, 4))
    values[offsets[:-1] + y, 0, 2] = 0.9  # layer 0, head 2 always on the decisive turn
    values[offsets[:-1][:2] + y[:2], 1, 1] = 0.8  # layer 1, head 1 on two of three
    summary = locators.locator_heads_summary(
        TurnFeatures(values, offsets, sites=["head_attn.0", "head_attn.1"]), y, top=2)
    assert summary["top"][0] == ["head_attn.0", 2, 1.0]
    assert summary["top"][1][:2] == ["head_attn.1", 1] and summary["top"][1][2] >= 2 / 3
    assert summary["chance"] == round(np.mean([1 / 3, 1 / 4, 1 / 3]), 4)


# rows that need neither a judge nor the probes' inner searches: a run takes a second
FAST_ROWS = "top_locator_head,position,most_frequent"
STEM = "locators_smoke_Algorithm-Generated"


def _count_calls(monkeypatch, name, fail_on=None):
    """Count the runner's calls of ``name``; raise on call number ``fail_on``."""
    real, calls = getattr(locators, name), []

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) == fail_on:
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(locators, name, counted)
    return calls


def test_resume_after_an_interruption_gives_the_uninterrupted_result(tmp_path, monkeypatch):
    bench = _load("benchmark_locators")
    out, cache = tmp_path / "out", str(tmp_path / "c")
    args = ["--smoke", "--rows", FAST_ROWS, "--cache-dir", cache]
    whole = bench.main(args + ["--out", str(tmp_path / "whole")])
    # killed in the second outer fit of the first row
    calls = _count_calls(monkeypatch, "top_locator_head", fail_on=2)
    with pytest.raises(RuntimeError, match="killed"):
        bench.main(args + ["--out", str(out), "--resume"])
    store = out / f"{STEM}.partial-top_locator_head.json"
    assert list(json.loads(store.read_text())["entries"]) == ["0|0"]
    assert not (out / f"{STEM}.json").exists()
    # resumed: only the missing fit is computed
    calls = _count_calls(monkeypatch, "top_locator_head")
    resumed = bench.main(args + ["--out", str(out), "--resume"])
    assert len(calls) == 1
    assert resumed["resumed"]["fits_reused"] == {"top_locator_head": 1}
    for key in ("predictions", "choices", "summary", "paired"):
        assert resumed[key] == whole[key], key
    # everything stored: no fit, and no head-attention features either: the heatmap's
    # summary was kept beside the stores (an activation cache may not outlive a session)
    heads_store = out / f"{STEM}.partial-locator_heads.json"
    assert json.loads(heads_store.read_text())["locator_heads"]["sites"]
    calls = _count_calls(monkeypatch, "top_locator_head")
    features = _count_calls(monkeypatch, "TurnActivationTransformer")
    again = bench.main(args + ["--out", str(out), "--resume"])
    assert calls == [] and features == []
    assert again["resumed"]["passes_not_rerun"] == ["features head_attn"]
    assert "features head_attn" not in again["times"]
    assert again["locator_heads"] == whole["locator_heads"]
    assert again["predictions"] == whole["predictions"]
    assert again["choices"] == whole["choices"]
    assert "Resumed (--resume)" in (out / f"{STEM}.md").read_text()
    # without the summary the features are read back from the cache (not extracted)
    kept = heads_store.read_text()
    heads_store.unlink()
    features = _count_calls(monkeypatch, "TurnActivationTransformer")
    assert bench.main(args + ["--out", str(out), "--resume"])["locator_heads"] == \
        whole["locator_heads"] and len(features) == 1
    assert heads_store.read_text() == kept
    # a summary of other settings, or a malformed one, is refused, naming the file
    doc = json.loads(kept)
    for bad in ({**doc, "signature": {**doc["signature"], "y": []}},
                {**doc, "locator_heads": {**doc["locator_heads"], "accuracy": [[2.0]]}},
                {**doc, "locator_heads": {**doc["locator_heads"], "sites": ["x"]}}):
        heads_store.write_text(json.dumps(bad))
        with pytest.raises(ResultStoreError, match="partial-locator_heads.json"):
            bench.main(args + ["--out", str(out), "--resume"])


def test_an_interrupted_judge_goes_on_conversation_by_conversation(tmp_path, monkeypatch,
                                                                    capsys):
    from skafa.baselines import PromptedJudge

    bench = _load("benchmark_locators")
    out = tmp_path / "out"
    args = ["--smoke", "--rows", "judge", "--out", str(out), "--resume"]
    whole = bench.main(["--smoke", "--rows", "judge", "--out", str(tmp_path / "whole")])
    real, calls, killed = PromptedJudge.turn_decision_function, [], []

    def scored(self, X):
        calls.append(len(X))
        if len(calls) == 6 and not killed:
            killed.append(1)
            raise RuntimeError("killed")
        return real(self, X)

    monkeypatch.setattr(PromptedJudge, "turn_decision_function", scored)
    with pytest.raises(RuntimeError, match="killed"):
        bench.main(args)
    kept = json.loads((out / f"{STEM}.partial-judge-scores.json").read_text())
    assert len(kept["entries"]) == 5
    calls.clear()
    capsys.readouterr()
    resumed = bench.main(args)
    assert sum(calls) == 20 - 5  # only the conversations not scored before
    # its bar counts the 15 scored now, weighted by FLOPs
    assert "15/15 conversations" in capsys.readouterr().err
    assert resumed["predictions"] == whole["predictions"]


def test_resume_reads_fits_stored_by_another_process_during_the_run(tmp_path, monkeypatch):
    """A row's store is read again just before the row is fitted: fits a second process
    stored meanwhile are used, not refitted, and not overwritten."""
    import shutil

    bench = _load("benchmark_locators")
    args = ["--smoke", "--rows", "position,most_frequent", "--resume"]
    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    whole = bench.main(args + ["--out", str(elsewhere)])
    name = f"{STEM}.partial-most_frequent.json"
    real_position, real_frequent = locators._FITS["position"], locators._FITS["most_frequent"]
    frequent_fits = []

    def position(cell, folds):  # runs first; meanwhile "another process" stores its row
        shutil.copyfile(elsewhere / name, out / name)
        yield from real_position(cell, folds)

    def most_frequent(cell, folds):
        for fit in real_frequent(cell, folds):
            frequent_fits.append(fit[:2])
            yield fit

    monkeypatch.setitem(locators._FITS, "position", position)
    monkeypatch.setitem(locators._FITS, "most_frequent", most_frequent)
    out.mkdir()
    result = bench.main(args + ["--out", str(out)])
    assert frequent_fits == []  # found in the store, not fitted again
    n_fits = len(json.loads((elsewhere / name).read_text())["entries"])
    assert n_fits >= 2 and result["resumed"]["fits_reused"] == {"most_frequent": n_fits}
    assert (out / name).read_bytes() == (elsewhere / name).read_bytes()
    assert result["predictions"] == whole["predictions"]
    assert result["summary"] == whole["summary"]


def test_resume_refuses_a_store_of_other_settings(tmp_path):
    bench = _load("benchmark_locators")
    args = ["--smoke", "--rows", "most_frequent", "--out", str(tmp_path), "--resume"]
    bench.main(args)
    store = tmp_path / f"{STEM}.partial-most_frequent.json"
    before = store.read_text()
    with pytest.raises(ResultStoreError, match="partial-most_frequent.json was written "
                                               "with other settings"):
        bench.main(args + ["--max-prompt-tokens", "256"])  # another prompt budget
    assert store.read_text() == before  # refused, not mixed in or overwritten
    FoldResultStore(tmp_path / f"{STEM}.partial-position.json", {"folds": 9}).put(
        0, 0, {"position": (np.zeros(3), None, {})})
    with pytest.raises(ResultStoreError, match="partial-position.json"):
        bench.main(args[:2] + ["position"] + args[3:])


def test_keep_kv_runs_the_grafted_judge_with_its_kv_kept_and_is_checked(tmp_path, monkeypatch):
    """--keep-kv needs --resume and --cache-dir; with them the grafted judge keeps its
    prompt KV caches for its store (keep_kv=True) and leaves no folder once done."""
    bench = _load("benchmark_locators")
    out, cache = tmp_path / "out", tmp_path / "c"
    for missing in (["--resume"], ["--cache-dir", str(cache)]):
        with pytest.raises(ValueError, match="keep_kv .--keep-kv. needs resume"):
            bench.main(["--smoke", "--rows", "grafted_judge", "--out", str(out), "--keep-kv",
                        *missing])
    seen = []
    real = locators.grafted_split_predictions

    def spy(*args, **kwargs):
        seen.append((kwargs["keep_kv"], kwargs["kv_dir"], kwargs["store"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(locators, "grafted_split_predictions", spy)
    result = bench.main(["--smoke", "--rows", "grafted_judge", "--out", str(out), "--resume",
                         "--cache-dir", str(cache), "--keep-kv"])
    assert seen and all(keep is True and kv == str(cache) and store is not None
                        for keep, kv, store in seen)
    assert "grafted_judge" in result["rows"] and "grafted_judge" not in result["missing_rows"]
    assert list(cache.glob("skafa-grafted-kv-*")) == []


def test_extract_only_fills_the_cache_and_writes_no_result(tmp_path):
    bench = _load("benchmark_locators")
    out, cache = tmp_path / "out", tmp_path / "c"
    args = ["--smoke", "--rows", "locator_probe,recommended,position", "--out", str(out),
            "--extract-only"]
    with pytest.raises(ValueError, match="needs cache_dir"):
        bench.main(args)
    with pytest.raises(ValueError, match="unknown rows"):
        bench.main(["--smoke", "--rows", "locator_prob", "--out", str(out)])
    shared_memory_cache().clear()  # earlier tests' features would be memory hits
    first = bench.main(args + ["--cache-dir", str(cache)])
    assert first["extract_only"] and first["extracted"] == {
        "features head_attn": {"extracted": 20, "cached": 0},
        "features recommended": {"extracted": 20, "cached": 0}}
    assert any(p.is_file() for p in cache.rglob("*"))
    assert not out.exists()  # no fit, no result file, no store
    shared_memory_cache().clear()
    again = bench.main(args + ["--cache-dir", str(cache)])
    assert again["extracted"] == {"features head_attn": {"extracted": 0, "cached": 20},
                                  "features recommended": {"extracted": 0, "cached": 20}}


def test_top_locator_head_picks_the_head_on_the_decisive_turn():
    rng = np.random.default_rng(0)
    offsets = np.array([0, 3, 7, 10])
    y = np.array([2, 0, 1])
    values = rng.uniform(0, 0.2, size=(10, 2, 4))
    values[offsets[:-1] + y, 1, 3] = 0.9  # layer 1, head 3 looks at the decisive turn
    X = TurnFeatures(values, offsets, sites=["head_attn.0", "head_attn.1"])
    site, head, mass = top_locator_head(X, y)
    assert (site, head) == ("head_attn.1", 3) and mass == 0.9


def test_gap_closed():
    groups = np.arange(40)
    judge = np.zeros(40)
    probe = np.ones(40)
    grafted = (np.arange(40) % 2).astype(float)  # closes half the gap
    out = gap_closed({"judge": judge, "recommended": probe, "grafted_judge": grafted},
                     groups, n_resamples=300)
    assert out["estimate"] == 0.5 and out["low"] <= 0.5 <= out["high"]
    # no gap: the probe is no better than the judge
    assert gap_closed({"judge": judge, "recommended": judge, "grafted_judge": grafted},
                      groups, n_resamples=300) is None


def test_the_judges_prompts_leave_room_for_their_answer_tokens(tmp_path, monkeypatch):
    from skafa.llm import context_length, load_model

    bench = _load("benchmark_locators")
    seen = {}

    def judge(settings, convs, template, cache_dir, store=None, earlier=None):
        seen["judge"] = template.max_prompt_tokens
        return np.zeros(len(convs), dtype=np.int64)

    def grafted(judge, X, y, splits, **kwargs):
        seen["grafted"] = judge.prompt.max_prompt_tokens
        return [np.zeros(len(test), dtype=np.int64) for _, test in splits], [{}] * len(splits)

    monkeypatch.setattr(locators, "judge_predictions", judge)
    monkeypatch.setattr(locators, "grafted_split_predictions", grafted)
    result = bench.main(["--smoke", "--rows", "judge,grafted_judge", "--max-prompt-tokens",
                         "1000000", "--out", str(tmp_path)])
    ctx = context_length(load_model("locators-smoke")[0])
    assert result["prompt_budget"] == ctx  # the features read up to the whole context
    assert seen == {"judge": ctx - 16, "grafted": ctx - 16} == {
        "judge": result["judge_prompt_budget"], "grafted": result["judge_prompt_budget"]}


_SIGTERM_SCRIPT = r'''
import importlib.util, os, signal, sys
from pathlib import Path
import skafa.baselines._grafted as grafted
import skafa.benchmarks._locators as locators

put = grafted._KVSpill.put
def put_then_sigterm(self, i, cache):  # SIGTERM once the first prompt's KV file exists
    put(self, i, cache)
    os.kill(os.getpid(), signal.SIGTERM)
grafted._KVSpill.put = put_then_sigterm
if sys.argv[3] == "unguarded":  # the control: the runner without its SIGTERM handler
    import contextlib
    grafted.stop_requests = contextlib.nullcontext  # nor the grafted judge's own
    locators.run_locator_benchmark = lambda s, c, log=None: locators._run_locator_benchmark(
        s, c, None, log)
spec = importlib.util.spec_from_file_location("bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
bench.run_locator_benchmark = locators.run_locator_benchmark
try:
    bench.main(["--smoke", "--rows", "grafted_judge", "--cache-dir", sys.argv[2],
                "--out", sys.argv[2]])
except KeyboardInterrupt as exc:
    print("interrupted:", exc)
'''


@pytest.mark.parametrize("mode", ["guarded", "unguarded"])
def test_sigterm_stops_the_run_and_removes_the_kv_folder(tmp_path, mode):
    # `nohup ... &` ignores Ctrl-C; `kill` sends SIGTERM, which must still run the
    # clean-up: the grafted judge's private KV folder in the cache goes away
    import subprocess
    import sys

    cache = tmp_path / "cache"
    script = tmp_path / "run.py"
    script.write_text(_SIGTERM_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(EXAMPLES / "benchmark_locators.py"),
                           str(cache), mode], capture_output=True, text=True, timeout=600)
    left = sorted(p.name for p in cache.glob("skafa-grafted-kv-*"))
    if mode == "guarded":
        assert done.returncode == 0, done.stderr[-2000:]
        assert "interrupted: stopped by signal" in done.stdout
        assert left == []
    else:  # without the handler SIGTERM kills the process: the folder stays
        assert done.returncode == -15
        assert len(left) == 1 and list((cache / left[0]).iterdir())


def test_recheck_grafts_recomputes_stored_graft_scorings(tmp_path):
    bench = _load("benchmark_locators")
    out = str(tmp_path / "out")
    bench.main(["--smoke", "--rows", "grafted_judge", "--resume", "--out", out])
    store = tmp_path / "out" / f"{STEM}.partial-grafted_judge-scores.json"
    files = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    got = bench.main(["--smoke", "--recheck-grafts", "5", "--out", out])["recheck_grafts"]
    assert got["n_checked"] == got["n_equal"] == 5 and got["threads"] >= 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == files  # no write
    assert store.name in files
    with pytest.raises(FileNotFoundError, match="no graft store"):
        bench.main(["--smoke", "--recheck-grafts", "5", "--out", str(tmp_path / "empty")])


def test_recommended_row_read_from_the_same_cells_section3_store(tmp_path, monkeypatch):
    """--recommended-from: §3's stored fits of the same cell give the row §8 computes."""
    from skafa.benchmarks import BenchmarkSettings, run_benchmark
    from skafa.configurations import RECOMMENDED
    from skafa.testing import make_conversations

    bench = _load("benchmark_locators")
    cache = str(tmp_path / "c")
    args = ["--smoke", "--rows", "recommended,position", "--cache-dir", cache]
    computed = bench.main(args + ["--out", str(tmp_path / "computed")])  # registers the model
    # §3's runner on the same cell: same model, records, prompt budget, sites and folds
    prereg = BenchmarkSettings(
        model="locators-smoke", tag="smoke", preregistered=True, reads=["echo"],
        sites="stride:3", folds=2, inner_folds=2, repeats=1, no_stack=True, no_mi4afa=True,
        no_judge=True, peer_n=0, n_resamples=50, resume=True, cache_dir=cache,
        out=str(tmp_path / "s3"))
    run_benchmark(prereg, make_conversations(20, seed=0), subset_label="Algorithm-Generated")
    store = tmp_path / "s3" / "prereg_smoke_Algorithm-Generated.partial-echo.json"
    stored = json.loads(store.read_text())
    assert RECOMMENDED in stored["entries"]["0|0"]
    calls = _count_calls(monkeypatch, "make_configuration")
    reused = bench.main(args + ["--out", str(tmp_path / "reused"),
                                "--recommended-from", str(store)])
    assert calls == []  # the recommended configuration's feature pass did not run
    assert reused["predictions"] == computed["predictions"]
    assert reused["choices"] == computed["choices"]
    assert reused["recommended_from"]["file"] == store.name
    md = (tmp_path / "reused" / "locators_smoke_Algorithm-Generated.md").read_text()
    assert "come from §3's fit store of the same cell" in md
    # its seconds are the reading, not a cost: no ratio to a forward pass
    assert f"(read from `{store.name}`, not computed here) | — |" in md

    def refused(doc, match):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(ResultStoreError, match=match):
            bench.main(args + ["--out", str(tmp_path / "x"), "--recommended-from", str(bad)])

    other = json.loads(json.dumps(stored))
    other["signature"]["dtype"] = "bfloat16"
    refused(other, r"not this cell's §3 store.*dtype \"bfloat16\", not \"float32\"")
    other = json.loads(json.dumps(stored))
    other["signature"]["y"][0] += 1
    refused(other, r"y \[")
    other = json.loads(json.dumps(stored))
    other["signature"]["model"]["weights_sha256"] = "0" * 64
    refused(other, "model ")
    other = json.loads(json.dumps(stored))
    del other["entries"]["0|1"][RECOMMENDED]
    refused(other, "no fit of 'echo: softmax/top3/acts' for repeat 0 fold 1")
    other = json.loads(json.dumps(stored))
    other["entries"]["0|0"][RECOMMENDED]["info"]["C"] = 5.0
    refused(other, "repeat 0 fold 0 has choices")
    other = json.loads(json.dumps(stored))
    other["entries"]["0|0"][RECOMMENDED]["pred"][0] = 10 ** 6
    refused(other, "steps beyond")
    refused({"entries": {}}, "not a fit store")


def test_judge_scores_read_from_another_runs_store_of_the_same_judge(tmp_path, monkeypatch):
    """--judge-scores-from: §3's judge score store gives the judge row §8 computes."""
    from skafa.baselines import PromptedJudge
    from skafa.benchmarks import BenchmarkSettings, run_benchmark
    from skafa.testing import make_conversations

    bench = _load("benchmark_locators")
    args = ["--smoke", "--rows", "judge,position", "--resume"]
    computed = bench.main(args + ["--out", str(tmp_path / "computed")])  # registers the model
    prereg = BenchmarkSettings(
        model="locators-smoke", tag="smoke", preregistered=True, reads=["last"],
        sites="all", folds=2, inner_folds=2, repeats=1, no_stack=True, no_mi4afa=True,
        peer_n=0, n_resamples=50, resume=True, out=str(tmp_path / "s3"))
    run_benchmark(prereg, make_conversations(20, seed=0), subset_label="Algorithm-Generated")
    store = tmp_path / "s3" / "prereg_smoke_Algorithm-Generated.partial-judge.json"
    stored = json.loads(store.read_text())
    assert len(stored["entries"]) == 20
    real, calls = PromptedJudge.turn_decision_function, []

    def counted(self, X):
        calls.append(1)
        return real(self, X)

    monkeypatch.setattr(PromptedJudge, "turn_decision_function", counted)
    out = tmp_path / "reused"
    reused = bench.main(args + ["--out", str(out), "--judge-scores-from", str(store)])
    assert calls == []  # every conversation's scores came from the other store
    assert reused["predictions"] == computed["predictions"]
    assert reused["judge_scores_from"]["file"] == store.name
    kept = json.loads((out / f"{STEM}.partial-judge-scores.json").read_text())
    assert len(kept["entries"]) == 20  # and are kept in this cell's own store
    md = (out / f"{STEM}.md").read_text()
    assert "--judge-scores-from" in md
    assert "| judge | " in md and "not computed here) | — |" in md

    def refused(doc, match):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(ResultStoreError, match=match):
            bench.main(args + ["--out", str(tmp_path / "x"), "--judge-scores-from", str(bad)])

    refused({**stored, "signature": {**stored["signature"], "dtype": "bfloat16"}},
            "another judge: .*fields")
    refused({**stored, "signature": {**stored["signature"], "prompt": "0" * 64}},
            "another judge: prompt")
    refused({**stored, "signature": {**stored["signature"], "model": {"kind": "hub"}}},
            "another judge: model")
    first = next(iter(stored["entries"]))
    other = json.loads(json.dumps(stored))
    other["entries"][first]["scores"].append(0.0)  # another conversation's scores
    refused(other, "of another conversation")
    refused([], "not a judge score store")


def test_committed_activation_cache_entries_pass_the_caches_checks():
    """docs/results/activation-cache holds cache entries of §8's long runs (copied into a
    run's cache folder): each must be read by ActivationCache under its own name."""
    from skafa.llm import ActivationCache
    from skafa.utils.fileio import json_field, read_safetensors

    folder = Path(__file__).resolve().parents[2] / "docs" / "results" / "activation-cache"
    paths = sorted(folder.glob("*/*.safetensors"))
    if not paths:
        pytest.skip("no committed activation-cache entries")
    cache = ActivationCache(folder, memory=False)
    for path in paths:
        key = path.name.removesuffix(".safetensors")
        assert path.parent.name == key[:2] and len(key) == 64, path
        tensors, meta = read_safetensors(path)
        shape = tensors["activations"].shape
        sites = json_field(meta, "sites")
        got = cache.get(key, sites, n_turns=shape[0], hidden_size=shape[2])
        assert got is not None and got.shape == shape and np.isfinite(got).all(), path
    assert cache.stats["corrupt"] == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted({p.parent.name for p in paths})


_DOC_ROWS = {"locator-head probe": "locator_probe", "top locator head": "top_locator_head",
             "grafted judge": "grafted_judge", "prompted judge": "judge",
             "recommended probe": "recommended", "position-only": "position",
             "TF-IDF": "tfidf", "most frequent step": "most_frequent"}


@pytest.mark.parametrize("marker, stem", [
    ("locator-table", "locators_smollm2_Algorithm-Generated"),
    ("locator-table-hand-crafted", "locators_smollm2_Hand-Crafted"),
    ("locator-table-qwen", "locators_qwen2.5-coder-0.5b_Algorithm-Generated"),
    ("locator-table-qwen-hand-crafted", "locators_qwen2.5-coder-0.5b_Hand-Crafted"),
    ("locator-table-qwen-1.5b", "locators_qwen2.5-coder-1.5b_Algorithm-Generated"),
])
def test_benchmarks_md_locator_tables_match_the_committed_result_files(marker, stem,
                                                                      benchmarks_md_table):
    """Each §8 table (docs/benchmarks/locators-grafting.md) shows its result file's numbers
    (step accuracy with its CI, lenient step, exact agent accuracy; percent, one decimal),
    every row; a row the result file names as not run says so, and only such a row."""
    import re

    docs = Path(__file__).resolve().parents[2] / "docs"
    _, rows = benchmarks_md_table(marker)
    result = json.loads((docs / "results" / f"{stem}.json").read_text())
    summary = result["summary"]
    seen = set()
    for cells in rows:
        row = _DOC_ROWS[re.sub(r"\s*\(.*\)$", "", cells[0])]
        seen.add(row)
        if row in result["missing_rows"]:
            assert row not in summary and cells[1:] == ["not computed yet", "—", "—"], row
            continue
        s = summary[row]
        step = s["step_accuracy"]
        want = [f"{100 * step['estimate']:.1f} [{100 * step['low']:.1f}, {100 * step['high']:.1f}]",
                f"{100 * s['lenient_step_accuracy']['estimate']:.1f}",
                f"{100 * s['agent_accuracy_exact']['estimate']:.1f}"]
        assert cells[1:] == want, (marker, row)
    assert seen == set(_DOC_ROWS.values()), marker
