"""The Who&When benchmark script runs end to end on the tiny random model (seconds)."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from skafa.benchmarks import (
    AUTO,
    judge_cache_head,
    mi4afa_activations,
    mi4afa_setup,
    preregistered_deviations,
    preregistered_names,
)
from skafa.configurations import PREREGISTERED_READS

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "benchmark_who_and_when.py"


def _load_example(name):
    """Import ``examples/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load():
    return _load_example("benchmark_who_and_when")


def test_benchmark_smoke(tmp_path):
    bench = _load()
    result = bench.main(["--smoke", "--out", str(tmp_path / "out"),
                         "--cache-dir", str(tmp_path / "cache")])
    methods = set(result["summary"]) - {"_uniform_expected"}
    expected = {"probe", "probe + position", "multi-site probe", "position-only", "TF-IDF",
                "dummy: first", "dummy: most_frequent", "dummy: most_frequent_relative",
                "dummy: uniform", "PromptedJudge (logprob)"}
    assert methods == expected
    for name in methods:
        r = result["summary"][name]
        assert r["n"] == 40
        acc = r["step_accuracy"]
        assert 0.0 <= acc["low"] <= acc["estimate"] <= acc["high"] <= 1.0
    assert len(result["site_curve_inner"]) == len(result["sites"]) == 5  # 2 layers -> 2L+1
    saved = json.loads((tmp_path / "out" / "smoke_synthetic.json").read_text())
    assert saved["paired"] and saved["best_baseline"] in methods
    assert "probe - PromptedJudge (logprob)" in saved["paired"]
    assert set(saved["predictions"]) == methods
    assert np.asarray(saved["predictions"]["probe"]).shape == (1, 40)
    md = (tmp_path / "out" / "smoke_synthetic.md").read_text()
    assert "| probe |" in md and "Paired differences" in md
    assert "| lenient step acc % (Who&When script) |" in md   # beside the exact one
    assert saved["summary"]["probe"]["lenient_step_accuracy"]["estimate"] >= \
        saved["summary"]["probe"]["step_accuracy"]["estimate"]
    # The judge's scores are cached conversation by conversation, as they come.
    assert len(list((tmp_path / "cache" / "judge").glob("*.json"))) == 40
    # A second run reads activations and judge scores from the cache: no forward pass.
    again = bench.main(["--smoke", "--out", str(tmp_path / "out2"),
                        "--cache-dir", str(tmp_path / "cache")])
    assert again["n_forward_passes"] == 0
    assert again["summary"]["probe"] == result["summary"]["probe"]
    assert "read at: last" in md
    # --read mean is another extraction (its own cache entries), reported as such.
    mean = bench.main(["--smoke", "--read", "mean", "--no-judge", "--tag", "smoke-mean",
                       "--out", str(tmp_path / "out3"), "--cache-dir", str(tmp_path / "cache")])
    assert mean["n_forward_passes"] == 40 and mean["read"] == "mean"
    assert "read at: mean" in (tmp_path / "out3" / "smoke-mean_synthetic.md").read_text()
    # The two runs compare pairwise from their JSONs.
    cmp = _load_example("compare_runs")
    rows = cmp.main([str(tmp_path / "out" / "smoke_synthetic.json"),
                     str(tmp_path / "out3" / "smoke-mean_synthetic.json"), "--n-resamples", "200"])
    assert "probe" in rows and "PromptedJudge (logprob)" not in rows  # B has no judge
    r = rows["probe"]
    assert r["diff"] == pytest.approx(r["a"] - r["b"])
    assert r["low"] <= r["diff"] <= r["high"]
    assert rows["position-only"]["diff"] == 0.0  # baselines do not depend on the read
    same = cmp.compare(saved, saved, methods=["probe"])
    assert same["probe"]["diff"] == same["probe"]["low"] == same["probe"]["high"] == 0.0
    with pytest.raises(ValueError, match="not in both runs"):
        cmp.compare(saved, saved, methods=["nope"])


@pytest.mark.parametrize("flag", ["--help"])
def test_benchmark_cli_help(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        _load().main([flag])
    assert exc.value.code == 0
    assert "--max-prompt-tokens" in capsys.readouterr().out


def test_preregistered_benchmark_smoke(tmp_path, capsys):
    """The pre-registered comparison runs every configuration, the auto rule and mi4afa."""
    pytest.importorskip("ag2.extensions.mi4afa", reason="ag2 (the test extra) not installed")
    bench = _load()
    result = bench.main(["--smoke", "--preregistered", "--reads", "last", "recap",
                         "--peer-n", "1", "--out", str(tmp_path / "out"),
                         "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out  # each read's plan and ETA before its extraction
    for read in ("last", "recap"):
        line = out.split(f"extraction plan, read={read}: ")[1].split("\n")[0]
        assert " of 40 conversations to extract" in line
        # an ETA unless another test of this process left them in the memory cache
        assert "ETA" in line or line.startswith("0 of 40"), line
    names = preregistered_names(("last", "recap"))
    assert len(names) == 18 and names[0] == "last: logistic/single/acts"
    summary = result["summary"]
    for name in [*names, AUTO, "position-only", "TF-IDF",
                 "mi4afa ProbeAttributor (ag2 1.2.1)"]:
        assert summary[name]["n"] == 40, name
    # the rule chose, in each outer fit, one of the pre-registered configurations
    chosen = [c["chosen"] for c in result["choices"] if c["method"] == AUTO]
    assert len(chosen) == 2 and set(chosen) <= set(names)
    # and its predictions are exactly that configuration's on those folds
    P = np.asarray(result["predictions"][AUTO])
    assert P.shape == (1, 40) and (P >= 0).all()
    assert f"{AUTO} - mi4afa ProbeAttributor (ag2 1.2.1)" in result["paired"]
    assert result["mi4afa"]["cost"]["skafa"]["n"] == 1
    md = (tmp_path / "out" / "prereg_smoke_synthetic.md").read_text()
    assert AUTO in md and "fixed configuration: recap: stack" in md
    for baseline in ("| position-only |", "| TF-IDF |", "| dummy: first |",
                     "| mi4afa ProbeAttributor (ag2 1.2.1) |"):
        assert baseline in md, baseline            # every baseline has its row
    # the smoke run leaves out echo and uses other sites and folds: said so
    assert "they can change rule step 1's choices" in md
    assert "reads echo not run: 18 of 27" in md
    assert "sites 'all' instead of 'stride:3'" in md and "GroupKFold(2) x 1 shuffles" in md


def test_prereg_deviations_name_the_dtype():
    """A cell run in another dtype says so, as a deviation that can change choices."""
    from skafa.benchmarks import BenchmarkSettings

    base = dict(reads=list(PREREGISTERED_READS), no_stack=False, sites="stride:3", folds=5,
                inner_folds=5, repeats=3, limit=None, judge_from=None, no_judge=False,
                no_mi4afa=False)
    assert preregistered_deviations(BenchmarkSettings(**base, dtype="float32")) == []
    args = BenchmarkSettings(**base, dtype="bfloat16")
    for choice_only in (False, True):
        (dev,) = preregistered_deviations(args, choice_only=choice_only)
        assert dev.startswith("model in bfloat16 instead of float32")


def test_preregistered_benchmark_resume(tmp_path):
    """--resume keeps each finished (read, outer fit) and a re-run reuses it exactly."""
    bench = _load()
    argv = ["--smoke", "--preregistered", "--reads", "last", "--no-mi4afa", "--no-stack",
            "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
            "--resume"]
    first = bench.main(argv)
    partial = tmp_path / "out" / "prereg_smoke_synthetic.partial-last.json"
    stored = json.loads(partial.read_text())
    assert sorted(stored["entries"]) == ["0|0", "0|1"]
    assert len(stored["entries"]["0|0"]) == 8          # configurations 1-8 of one read
    # tamper with one stored prediction: the re-run must reuse it, not recompute it
    entry = stored["entries"]["0|0"]["last: logistic/single/acts"]
    assert any(entry["pred"])
    entry["pred"] = [0] * len(entry["pred"])
    partial.write_text(json.dumps(stored))
    second = bench.main(argv)
    a = np.asarray(first["predictions"]["last: logistic/single/acts"])
    b = np.asarray(second["predictions"]["last: logistic/single/acts"])
    assert (a != b).any()                              # the stored (tampered) fit was used
    assert second["predictions"]["TF-IDF"] == first["predictions"]["TF-IDF"]
    # every fit of the read stored: its turn vectors are not even extracted
    assert "extraction last" in first["times"] and "extraction last" not in second["times"]
    one_missing = json.loads(json.dumps(stored))
    del one_missing["entries"]["0|1"]
    partial.write_text(json.dumps(one_missing))
    third = bench.main(argv)
    assert "extraction last" in third["times"]          # a fit to do: extracted again
    assert third["predictions"] == second["predictions"]
    # a stored fit of the wrong length: refused, naming the file and the fit
    entry["pred"] = entry["pred"][:-1]
    partial.write_text(json.dumps(stored))
    with pytest.raises(SystemExit, match=r"partial-last\.json.*'last: logistic/single/acts'"):
        bench.main(argv)
    # other settings: refused, not mixed in
    with pytest.raises(SystemExit, match="other settings"):
        bench.main([*argv, "--sites", "resid_final"])


def test_mi4afa_runs_on_a_tokenizer_without_chat_template():
    """A base model's tokenizer has no chat template, which mi4afa's prompt needs: mi4afa
    gets a copy rendering skafa's plain text (the caller's tokenizer is left alone)."""
    pytest.importorskip("ag2.extensions.mi4afa", reason="ag2 (the test extra) not installed")
    import copy

    from skafa.llm import PromptTemplate
    from skafa.llm._prompt import _plain_text
    from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

    tok = copy.deepcopy(make_tiny_tokenizer())
    tok.chat_template = None
    convs = make_conversations(3, seed=2)
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=2048)
    ext, peer_convs, n_extra = mi4afa_setup(make_tiny_llama(max_position_embeddings=4096),
                                                  tok, convs, template, [0], 2)
    assert tok.chat_template is None and ext.tokenizer is not tok and n_extra == 0
    for pc, conv in zip(peer_convs, convs):
        msgs = ext.template.messages(pc)
        text = ext.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert text == _plain_text(tok, msgs)
        enc = ext.encode(pc)
        assert len(enc.turn_positions) == len(conv)


def test_mi4afa_activations_float32_and_keyed_by_dtype(tmp_path, capsys):
    """A bfloat16 model's mi4afa activations: float32 whether extracted or read back,
    and cached under a key of their own (never a float32 run's entries). A FLOP-weighted
    bar shows the passes that run; a warm cache runs none and shows none."""
    pytest.importorskip("ag2.extensions.mi4afa", reason="ag2 (the test extra) not installed")
    import torch

    from skafa.llm import PromptTemplate
    from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

    convs = make_conversations(2, seed=3)
    template = PromptTemplate(shorten="middle_first", max_prompt_tokens=2048)
    model = make_tiny_llama(max_position_embeddings=4096)
    got = {}
    for dtype in ("float32", "bfloat16"):
        ext, peer_convs, _ = mi4afa_setup(model.to(getattr(torch, dtype)),
                                                make_tiny_tokenizer(), convs, template, [0], 2)
        capsys.readouterr()
        cold, _, _ = mi4afa_activations(ext, peer_convs, tmp_path, "m", dtype=dtype)
        err = capsys.readouterr().err
        assert "FLOP" in err and "2/2 conversations" in err
        warm, _, _ = mi4afa_activations(ext, peer_convs, tmp_path, "m", dtype=dtype)
        assert "mi4afa" not in capsys.readouterr().err
        for a, b in zip(cold, warm):
            assert a.values.dtype == b.values.dtype == torch.float32
            assert torch.equal(a.values, b.values)
        got[dtype] = cold
    assert len(list((tmp_path / "mi4afa").glob("*.safetensors"))) == 4   # 2 records x 2 dtypes
    assert not torch.equal(got["float32"][0].values, got["bfloat16"][0].values)


def test_judge_cache_key_names_a_non_float32_dtype():
    """The judge's cached scores of a bfloat16 model are never a float32 run's."""
    import argparse
    import types

    from skafa.llm import PromptTemplate

    judge = types.SimpleNamespace(model_identity_={"kind": "gguf", "file_digest": "d"},
                                  answer_prefix="Step ")
    t = PromptTemplate()
    f32 = judge_cache_head(judge, argparse.Namespace(model="m", dtype="float32"), t)
    bf16 = judge_cache_head(judge, argparse.Namespace(model="m", dtype="bfloat16"), t)
    assert "dtype" not in f32 and bf16 == {**f32, "dtype": "bfloat16"}


def test_preregistered_extract_only_fills_caches(tmp_path):
    """--extract-only fills skafa's and mi4afa's caches and fits nothing."""
    pytest.importorskip("ag2.extensions.mi4afa", reason="ag2 (the test extra) not installed")
    bench = _load()
    cache = tmp_path / "cache"
    argv = ["--smoke", "--preregistered", "--reads", "last", "--extract-only",
            "--out", str(tmp_path / "out"), "--cache-dir", str(cache)]
    got = bench.main(argv)
    assert got["extract_only"] and "extraction mi4afa" in got["times"]
    files = sorted((cache / "mi4afa").glob("*.safetensors"))
    assert len(files) == 40
    assert not (tmp_path / "out").exists()            # no fit, no result file
    from safetensors import safe_open

    with safe_open(str(files[0]), framework="pt") as f:
        assert float(f.metadata()["seconds"]) > 0


def test_preregistered_judge_from_earlier_result(tmp_path):
    """--judge-from reuses an earlier run's judge only for the same model, records, prompt."""
    bench = _load()
    cache = str(tmp_path / "cache")
    first = bench.main(["--smoke", "--out", str(tmp_path / "a"), "--cache-dir", cache])
    path = tmp_path / "a" / "smoke_synthetic.json"
    argv = ["--smoke", "--preregistered", "--reads", "last", "--no-mi4afa", "--no-stack",
            "--out", str(tmp_path / "b"), "--cache-dir", cache, "--judge-from", str(path)]
    second = bench.main(argv)
    name = "PromptedJudge (logprob)"
    assert second["predictions"][name] == first["predictions"][name]
    assert any("reused from smoke_synthetic.json" in d for d in second["deviations"])
    assert not any("reused" in d or "mi4afa" in d for d in second["choice_deviations"])
    assert any("reads recap, echo not run" in d for d in second["choice_deviations"])
    saved = json.loads(path.read_text())
    assert saved["dtype"] == "float32"
    # another dtype, named in the file or (older files) only in its command: refused
    for dtype_at in ("field", "command"):
        other = dict(saved)
        if dtype_at == "field":
            other["dtype"] = "bfloat16"
        else:
            del other["dtype"]
            other["command"] += " --dtype bfloat16"
        path.write_text(json.dumps(other))
        with pytest.raises(SystemExit, match="dtype bfloat16, not float32"):
            bench.main(argv)
    saved["record_ids"] = saved["record_ids"][::-1]
    path.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="other records"):
        bench.main(argv)


def _load_rule():
    return _load_example("apply_prereg_rule")


def test_apply_prereg_rule_counts_complete_cells_only(tmp_path):
    rule = _load_rule()
    order = ["last: a", "last: b", "recap: a"]

    def cell(name, choices, deviations=(), subset="Algorithm-Generated"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"preregistered": True, "tag": name, "subset": subset,
                                    "order": order, "auto_choices": choices,
                                    "deviations": list(deviations)}))
        return path

    a = cell("m1", {"last: b": 3, "recap: a": 2})
    b = cell("m2", {"recap: a": 1, "last: a": 4})
    c = cell("m3", {"last: a": 15}, deviations=["reads echo not run"])
    d = cell("m1hc", {"last: a": 15}, subset="Hand-Crafted")
    out = rule.apply_rule([a, b, c, d])
    assert out["tally"] == {"last: b": 3, "recap: a": 3, "last: a": 4}
    assert out["winner"] == "last: a" and out["complete"] == ["m1 / Algorithm-Generated",
                                                             "m2 / Algorithm-Generated"]
    assert [why for _, why in out["left_out"]] == ["reads echo not run",
                                                   "not Algorithm-Generated"]
    # ties go to the pre-registered order
    e = cell("m4", {"recap: a": 1, "last: b": 0})
    assert rule.apply_rule([a, e])["tally"] == {"last: b": 3, "recap: a": 3}
    assert rule.apply_rule([a, e])["winner"] == "last: b"
    f = cell("m5", {"recap: a": 4, "last: b": 3})
    assert rule.apply_rule([f])["winner"] == "recap: a"
    # no complete cell: no winner
    assert rule.apply_rule([c])["winner"] is None
    # a reused judge or a missing mi4afa row changes a row, not a choice: still complete
    path = tmp_path / "m6.json"
    path.write_text(json.dumps({"preregistered": True, "tag": "m6",
                                "subset": "Algorithm-Generated", "order": order,
                                "auto_choices": {"recap: a": 2},
                                "deviations": ["judge reused", "no mi4afa row"],
                                "choice_deviations": []}))
    assert rule.apply_rule([path])["winner"] == "recap: a"
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "choice_deviations": ["first 9 records only"]}))
    assert rule.apply_rule([path])["winner"] is None


def test_apply_prereg_rule_on_the_committed_result_gives_the_default():
    """The committed SmolLM2 cell is complete, and the rule picks skafa's default."""
    from skafa.configurations import RECOMMENDED

    rule = _load_rule()
    path = (Path(__file__).resolve().parents[2] / "docs" / "results"
            / "prereg_smollm2_Algorithm-Generated.json")
    out = rule.apply_rule([path])
    assert out["complete"] == ["smollm2 / Algorithm-Generated"] and out["left_out"] == []
    assert sum(out["tally"].values()) == 15
    assert out["winner"] == RECOMMENDED


def test_apply_prereg_rule_reader_rule_on_the_committed_cells(capsys):
    """--reader-rule: the 1.5B cell's own recommendation, none for the 0.5B cell (its
    headline's CI against position-only includes 0), and one file only."""
    from skafa.configurations import RECOMMENDED_FOR_READER

    rule = _load_rule()
    folder = Path(__file__).resolve().parents[2] / "docs" / "results"
    out = rule.main(["--reader-rule", str(folder / "prereg_qwen2.5-coder-1.5b_Algorithm-Generated.json")])
    assert out["winner"] == RECOMMENDED_FOR_READER["qwen2.5-coder-1.5b"]
    assert "recommended for this reader" in capsys.readouterr().out
    out = rule.main(["--reader-rule", str(folder / "prereg_qwen2.5-coder-0.5b_Algorithm-Generated.json")])
    assert out["winner"] is None and "no recommendation" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rule.main(["--reader-rule", "a.json", "b.json"])


def test_the_default_follows_the_rule_on_every_committed_cell():
    """Rule step 2 over all committed Algorithm-Generated cells still picks the default.

    A newly committed complete cell that changes the tally fails this test until
    ``skafa.configurations.RECOMMENDED`` follows it; a partial cell is left out, named.
    """
    from skafa.configurations import RECOMMENDED

    rule = _load_rule()
    paths = sorted((Path(__file__).resolve().parents[2] / "docs" / "results")
                   .glob("prereg_*_Algorithm-Generated.json"))
    out = rule.apply_rule(paths)
    assert len(out["complete"]) + len(out["left_out"]) == len(paths)
    assert out["winner"] == RECOMMENDED


def test_prereg_inner_scores_reads_rule_step_one_inputs():
    module = _load_example("prereg_inner_scores")
    result = {
        "order": ["a", "b"],
        "summary": {"a": {"step_accuracy": {"estimate": 0.3}},
                    "b": {"step_accuracy": {"estimate": 0.2}}},
        "choices": [
            {"repeat": 0, "fold": 0, "method": "a", "inner_score": 0.5},
            {"repeat": 0, "fold": 0, "method": "b", "inner_score": 0.4},
            {"repeat": 0, "fold": 1, "method": "a", "inner_score": 0.3},
            {"repeat": 0, "fold": 1, "method": "b", "inner_score": 0.4},
            {"repeat": 0, "fold": 0, "method": "auto", "inner_score": None},
        ]}
    out = module.inner_scores(result)
    assert out["mean_inner"] == pytest.approx({"a": 0.4, "b": 0.4})
    assert out["lead"] == pytest.approx(0.1)        # 0.5-0.4 and 0.4-0.3
    assert out["optimism"] == pytest.approx(0.15)   # (0.4-0.3 + 0.4-0.2) / 2


def test_preregistered_judge_store_resumes_without_the_cache(tmp_path):
    """--resume keeps the judge's scores with the results; a run with a new cache reads them."""
    bench = _load()
    out = tmp_path / "out"
    argv = ["--smoke", "--preregistered", "--reads", "last", "--no-mi4afa", "--no-stack",
            "--out", str(out), "--resume"]
    first = bench.main([*argv, "--cache-dir", str(tmp_path / "cache1")])
    store = out / "prereg_smoke_synthetic.partial-judge.json"
    saved = json.loads(store.read_text())
    assert len(saved["entries"]) == 40 and saved["signature"]["answer_prefix"]
    # change one stored score vector so that its argmax moves: a fresh cache must read it
    rid, entry = next(iter(saved["entries"].items()))
    scores = np.asarray(entry["scores"])
    entry["scores"] = [1.0 if i == int(np.argmin(scores)) else 0.0 for i in range(len(scores))]
    store.write_text(json.dumps(saved))
    second = bench.main([*argv, "--cache-dir", str(tmp_path / "cache2")])
    name = "PromptedJudge (logprob)"
    a, b = (np.asarray(r["predictions"][name])[0] for r in (first, second))
    assert (a != b).sum() == 1                          # only the tampered record moved
    assert not any((tmp_path / "cache2").rglob("judge/*.json"))   # nothing re-scored
    # a stored entry of another conversation (turn count): refused, naming the record
    entry["scores"] = entry["scores"][:-1]
    store.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match=f"judge scores of {rid}"):
        bench.main([*argv, "--cache-dir", str(tmp_path / "cache3")])
    # other settings (dtype): refused, not mixed in
    saved["signature"]["dtype"] = "bfloat16"
    store.write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="judge scores of other settings"):
        bench.main([*argv, "--cache-dir", str(tmp_path / "cache4")])


def test_model_tag_keeps_readers_apart():
    from skafa.benchmarks import model_tag

    assert model_tag("qwen2.5-coder-0.5b") != model_tag("qwen2.5-coder-1.5b")
    assert model_tag("QWEN2.5-Coder-1.5B") == "qwen2.5-coder-1.5b"  # a known name, as known
    assert model_tag("smollm2") == "smollm2"
    assert model_tag("/m/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") == \
        "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert model_tag("/m/qwen2.5-coder-0.5b-instruct.gguf") == "qwen2.5-coder-0.5b-instruct"
    assert model_tag("Qwen/Qwen2.5-0.5B") == "Qwen2.5-0.5B"


# ------------------------------------------- docs/benchmarks/*.md tables (the study pages)

_DOCS = Path(__file__).resolve().parents[2] / "docs"
_HEADLINE = "skafa (pre-registered auto)"
_MI4AFA = "mi4afa ProbeAttributor (ag2 1.2.1)"
_MODEL_TAGS = {"SmolLM2-135M-Instruct": "smollm2", "Qwen2.5-Coder-0.5B-Instruct": "qwen2.5-coder-0.5b",
               "Qwen2.5-Coder-0.5B-Instruct (bfloat16)": "qwen2.5-coder-0.5b",
               "Gemma-3-270M (base)": "gemma-3-270m"}


def _pct(x):
    return f"{100 * x:.1f}"


def _ci(s):
    return f"{_pct(s['estimate'])} [{_pct(s['low'])}, {_pct(s['high'])}]"


def _signed_ci(d):
    def sign(x):
        return "0.0" if round(100 * x, 1) == 0 else f"{100 * x:+.1f}".replace("-", "−")
    return f"{sign(d['estimate'])} [{sign(d['low'])}, {sign(d['high'])}]"


def _prereg(tag, subset):
    return json.loads((_DOCS / "results" / f"prereg_{tag}_{subset}.json").read_text())


def test_benchmarks_md_section_3_algorithm_generated_table_matches_the_result_files(
        benchmarks_md_table):
    """§3's Algorithm-Generated table: each reader's headline with its CI and its paired
    differences to TF-IDF, position-only and mi4afa, from the pre-registered result files."""
    header, rows = benchmarks_md_table("prereg-table-algorithm-generated")
    assert header[1:] == [_HEADLINE, "− TF-IDF", "− position-only", "− mi4afa"]
    assert len(rows) == 3
    for cells in rows:
        r = _prereg(_MODEL_TAGS[cells[0]], "Algorithm-Generated")
        assert r["summary"][_HEADLINE]["n"] == 100
        want = [_ci(r["summary"][_HEADLINE]["step_accuracy"])]
        want += [_signed_ci(r["paired"][f"{_HEADLINE} - {base}"])
                 for base in ("TF-IDF", "position-only", _MI4AFA)]
        assert cells[1:] == want, cells[0]


def test_benchmarks_md_section_3_hand_crafted_table_matches_the_result_files(
        benchmarks_md_table):
    """§3's Hand-Crafted table: budget, headline with CI, paired differences, and the
    baselines' accuracies named in the header and next to mi4afa's difference."""
    header, rows = benchmarks_md_table("prereg-table-hand-crafted")
    assert header[1:3] == ["budget", _HEADLINE]
    assert len(rows) == 3
    for cells in rows:
        r = _prereg(_MODEL_TAGS[cells[0]], "Hand-Crafted")
        s = r["summary"]
        assert s[_HEADLINE]["n"] == 30
        assert cells[1] == f"{r['budget']:,}", cells[0]
        assert cells[2] == _ci(s[_HEADLINE]["step_accuracy"]), cells[0]
        for col, base, label in ((3, "dummy: most_frequent", "best baseline (most_frequent, "),
                                 (4, "position-only", "position-only ("),
                                 (5, "TF-IDF", "TF-IDF (")):
            assert header[col] == f"− {label}{_pct(s[base]['step_accuracy']['estimate'])}%)"
            assert cells[col] == _signed_ci(r["paired"][f"{_HEADLINE} - {base}"]), (cells[0], base)
        assert cells[6] == (f"{_signed_ci(r['paired'][f'{_HEADLINE} - {_MI4AFA}'])} "
                            f"({_pct(s[_MI4AFA]['step_accuracy']['estimate'])}%)"), cells[0]
        if "bfloat16" in cells[0]:
            assert r["dtype"] == "bfloat16"


_REMATCH_ROWS = {"skafa (pre-registered auto)": _HEADLINE, "TF-IDF (best baseline)": "TF-IDF",
                 "mi4afa `ProbeAttributor` (ag2 1.2.1), same 1.5B model": _MI4AFA,
                 "position-only": "position-only", "dummy: most_frequent": "dummy: most_frequent",
                 "PromptedJudge (logprob, same 1.5B model)": "PromptedJudge (logprob)"}


def test_benchmarks_md_section_7_tables_match_the_result_file(benchmarks_md_table):
    """§7's 1.5B Algorithm-Generated tables: every method's step accuracy with CI, lenient
    step, agent, within-1 and mean shift, and the paired differences, from the result file."""
    r = _prereg("qwen2.5-coder-1.5b", "Algorithm-Generated")
    _, rows = benchmarks_md_table("rematch-table-qwen-1.5b")
    assert {cells[0] for cells in rows} == set(_REMATCH_ROWS)
    for cells in rows:
        s = r["summary"][_REMATCH_ROWS[cells[0]]]
        shift = s["mean_abs_shift"]
        assert cells[1:] == [_ci(s["step_accuracy"]), _pct(s["lenient_step_accuracy"]["estimate"]),
                             _ci(s["agent_accuracy_normalized"]), _ci(s["within_1"]),
                             f"{shift['estimate']:.2f} [{shift['low']:.2f}, {shift['high']:.2f}]"
                             ], cells[0]
    _, rows = benchmarks_md_table("rematch-paired-qwen-1.5b")
    names = {"TF-IDF (the best baseline)": "TF-IDF", "position-only": "position-only",
             "PromptedJudge (logprob)": "PromptedJudge (logprob)",
             "mi4afa `ProbeAttributor`": _MI4AFA}
    assert {cells[0] for cells in rows} == set(names)
    for cells in rows:
        assert cells[1] == _signed_ci(r["paired"][f"{_HEADLINE} - {names[cells[0]]}"]), cells[0]


def _method_key(label, keys):
    """The result file's method a §2 row names: the label itself, or the label without
    the note in brackets the table adds ("dummy: first (always step 0)")."""
    if label in keys:
        return label
    base = label.split(" (")[0]
    if base == "PromptedJudge":
        return "PromptedJudge (logprob)"
    assert base in keys, label
    return base


def _estimate_or_ci(cell, s):
    """A cell that gives the estimate alone or with its CI; both must be the file's."""
    return cell in (_pct(s["estimate"]), _ci(s))


@pytest.mark.parametrize("marker, tag, subset, n", [
    ("wnw-table-smollm2-ag", "smollm2-135m", "Algorithm-Generated", 100),
    ("wnw-table-qwen-0.5b-ag", "qwen2.5-coder-0.5b", "Algorithm-Generated", 100),
    ("wnw-table-smollm2-hc", "smollm2-135m", "Hand-Crafted", 10),
    ("wnw-table-qwen-0.5b-hc", "qwen2.5-coder-0.5b", "Hand-Crafted", 10)])
def test_benchmarks_md_section_2_tables_match_the_result_files(benchmarks_md_table, marker, tag,
                                                               subset, n):
    """§2's main-run tables: each method once (the probes, the judge and the baselines at
    least; Hand-Crafted's tables leave three dummies to the full result), with its step accuracy
    and CI, agent accuracy (the three rules, or one where the table says they agree),
    within-1, mean shift and n."""
    r = json.loads((_DOCS / "results" / f"{tag}_{subset}.json").read_text())
    s = r["summary"]
    header, rows = benchmarks_md_table(marker)
    methods = [_method_key(cells[0], s) for cells in rows]
    assert len(set(methods)) == len(methods)
    assert {"probe", "probe + position", "multi-site probe", "position-only", "TF-IDF",
            "PromptedJudge (logprob)", "dummy: most_frequent"} <= set(methods)
    for cells, m in zip(rows, methods):
        cells = [c.replace("**", "") for c in cells]
        assert cells[1] == _ci(s[m]["step_accuracy"]), (marker, m)
        assert cells[-1] == str(n) == str(s[m]["n"]), (marker, m)
        rules = [s[m][f"agent_accuracy_{rule}"] for rule in ("exact", "normalized", "substring")]
        if "exact / normalized / substring" in header[2]:
            assert cells[2] == " / ".join(_pct(a["estimate"]) for a in rules), (marker, m)
        else:  # one figure: the three rules agree on this subset
            assert len({_pct(a["estimate"]) for a in rules}) == 1, (marker, m)
            assert _estimate_or_ci(cells[2], rules[1]), (marker, m)
        if len(cells) == 6:
            assert cells[3] == _pct(s[m]["within_1"]["estimate"]), (marker, m)
            assert cells[4] == f"{s[m]['mean_abs_shift']['estimate']:.2f}", (marker, m)
        if m == "dummy: uniform":
            assert cells[0] == f"dummy: uniform (expected {_pct(s['_uniform_expected'])})"


@pytest.mark.parametrize("marker, tag", [("wnw-paired-smollm2-ag", "smollm2-135m"),
                                         ("wnw-paired-qwen-0.5b-ag", "qwen2.5-coder-0.5b")])
def test_benchmarks_md_section_2_paired_tables_match_the_result_files(benchmarks_md_table,
                                                                      marker, tag):
    """§2's paired differences (probe variants − baselines), from the result file."""
    r = json.loads((_DOCS / "results" / f"{tag}_Algorithm-Generated.json").read_text())
    _, rows = benchmarks_md_table(marker)
    assert len(rows) >= 7
    for cells in rows:
        left, right = cells[0].split(" − ")
        key = f"{left} - {_method_key(right, r['summary'])}"
        assert cells[1] == _signed_ci(r["paired"][key]), (marker, cells[0])


_CELLS = [("smollm2-ag", "smollm2", "Algorithm-Generated"),
          ("qwen-0.5b-ag", "qwen2.5-coder-0.5b", "Algorithm-Generated"),
          ("gemma-ag", "gemma-3-270m", "Algorithm-Generated"),
          ("smollm2-hc", "smollm2", "Hand-Crafted"),
          ("gemma-hc", "gemma-3-270m", "Hand-Crafted"),
          ("qwen-0.5b-hc", "qwen2.5-coder-0.5b", "Hand-Crafted")]


def _prereg_method(label, summary):
    """The result file's method a §3 cell row names (the table shortens some names and
    adds notes in brackets: "TF-IDF (best baseline)", "PromptedJudge (logprob, same model)")."""
    if label.startswith("skafa"):
        return _HEADLINE
    if label.startswith("mi4afa"):
        return _MI4AFA
    if label.startswith("PromptedJudge"):
        return "PromptedJudge (logprob)"
    base = label.split(" (")[0]
    assert base in summary, label
    return base


def _ci2(s):
    return f"{s['estimate']:.2f} [{s['low']:.2f}, {s['high']:.2f}]"


@pytest.mark.parametrize("cell, tag, subset", _CELLS)
def test_benchmarks_md_section_3_cell_tables_match_the_result_files(benchmarks_md_table, cell,
                                                                    tag, subset):
    """Each of §3's six cells: the method table (step accuracy, normalized agent accuracy,
    within-1 and mean shift, each with its CI), the paired differences of the auto row, and
    per read the range of the eight fixed configurations' outer accuracies, the stacking
    row and the range of their mean inner scores."""
    r = _prereg(tag, subset)
    s = r["summary"]
    _, rows = benchmarks_md_table(f"prereg-cell-{cell}")
    methods = [_prereg_method(cells[0], s) for cells in rows]
    assert len(set(methods)) == len(methods)
    assert {_HEADLINE, _MI4AFA, "PromptedJudge (logprob)", "position-only",
            "TF-IDF", r["best_baseline"]} <= set(methods)
    for cells, m in zip(rows, methods):
        assert cells[1:] == [_ci(s[m]["step_accuracy"]), _ci(s[m]["agent_accuracy_normalized"]),
                             _ci(s[m]["within_1"]), _ci2(s[m]["mean_abs_shift"])], (cell, m)
        if "best baseline" in cells[0]:
            assert m == r["best_baseline"], cell

    _, rows = benchmarks_md_table(f"prereg-cell-paired-{cell}")
    assert len(rows) == len(r["paired"]) >= 4
    for cells in rows:
        key = f"{_HEADLINE} - {_prereg_method(cells[0], s)}"
        assert cells[1] == _signed_ci(r["paired"][key]), (cell, cells[0])

    inner = _load_example("prereg_inner_scores").inner_scores(r)["mean_inner"]

    def span(values):
        lo, hi = min(values), max(values)
        return _pct(lo) if _pct(lo) == _pct(hi) else f"{_pct(lo)}–{_pct(hi)}"

    _, rows = benchmarks_md_table(f"prereg-cell-reads-{cell}")
    assert [cells[0] for cells in rows] == ["`last`", "`recap`", "`echo`"]
    for cells in rows:
        read = cells[0].strip("`")
        fixed = [k for k in r["order"] if k.startswith(f"{read}: ") and "stack(" not in k]
        stack = next(k for k in r["order"] if k.startswith(f"{read}: stack("))
        assert len(fixed) == 8, (cell, read)
        assert cells[1:] == [span([s[k]["step_accuracy"]["estimate"] for k in fixed]),
                             _pct(s[stack]["step_accuracy"]["estimate"]),
                             span([inner[k] for k in fixed])], (cell, read)
