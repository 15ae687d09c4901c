"""The main job (:mod:`skafa.benchmarks`: prepare, extract, cross-validate, attribute) and
its command ``examples/quickstart.py``, on tiny random models (seconds)."""

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from skafa.benchmarks import MainJobSettings, main_job_table, prepare_main_job
from skafa.exceptions import PromptTooLongError
from skafa.llm import ActivationCache, register_model, shared_memory_cache, unregister_model
from skafa.testing import (
    make_conversations,
    make_tiny_llama,
    make_tiny_tokenizer,
    write_who_and_when,
)

MODEL = "main-job-tiny"
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-main-job")
    make_tiny_llama(n_layers=3, seed=5).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def _quickstart():
    spec = importlib.util.spec_from_file_location("skafa_example_quickstart", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_quickstart(data, n_resamples, n_jobs="1", *extra):
    """examples/quickstart.py's main on the tiny model, memory cache only."""
    return _quickstart().main(["--data", str(data), "--model", MODEL, "--cache-dir", "",
                               "--sites", "stride:1", "--n-resamples", n_resamples,
                               "--n-jobs", n_jobs, *extra])


# ------------------------------------------------------------------ the package steps
def test_prepare_names_sites_that_do_not_parse(tmp_path):
    data = write_who_and_when(tmp_path / "wnw", make_conversations(6, seed=1))
    settings = MainJobSettings(data=str(data), model=MODEL, sites="stride:0")
    with pytest.raises(ValueError, match="--sites: "):
        prepare_main_job(settings)
    with pytest.raises(SystemExit, match="--sites: "):
        _quickstart().main(["--data", str(data), "--model", MODEL, "--sites", "banana.3"])


def test_prepare_refuses_prompts_that_cannot_fit(tmp_path):
    """Hundreds of turns do not fit a 512-token context however much text is cut."""
    convs = make_conversations(6, seed=2)
    turn = convs[0].turns[0]
    convs[0] = dataclasses.replace(convs[0], turns=tuple(
        dataclasses.replace(turn, content=f"turn {i}") for i in range(400)), mistake_step=3)
    data = write_who_and_when(tmp_path / "wnw", convs)
    lines = []
    settings = MainJobSettings(data=str(data), model=MODEL, sites="all")
    with pytest.raises(PromptTooLongError, match="cannot be shortened enough to fit: "):
        prepare_main_job(settings, log=lines.append)
    assert lines[0].startswith("data: 6 conversations (Algorithm-Generated)")
    assert any(line.startswith("prompts: 1 of 6 exceed the 512-token context") for line in lines)


def test_prepare_returns_the_job(tmp_path):
    """What the run needs; the run itself is exercised by the quickstart tests below."""
    convs = make_conversations(20, seed=4)
    data = write_who_and_when(tmp_path / "wnw", convs)
    lines = []
    job = prepare_main_job(MainJobSettings(data=str(data), model=MODEL, sites="stride:1",
                                           limit=16, n_resamples=50), log=lines.append)
    assert len(job.conversations) == 16 and job.sites == ["resid_pre.0", "resid_pre.1",
                                                          "resid_final"]
    np.testing.assert_array_equal(job.y, [c.mistake_step for c in convs[:16]])
    assert list(job.groups) == [c.task_id for c in convs[:16]]
    assert set(job.times) == {"model load", "prompt planning"}
    assert job.read == "last" or job.configuration.startswith(job.read)
    assert job.plan.all_fit and len(lines) == 5  # data, model, configuration, prompts x2
    assert lines[3].startswith("prompts: 0 of 16 exceed") and lines[4].endswith(".")


def test_main_job_table_is_the_accuracy_with_a_ci():
    y = np.array([0, 1, 2, 1, 0, 2])
    groups = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    speakers = {0: "x", 1: "y", 2: "z"}
    true_agents = ["x", "y", "z", "y", "y", "z"]
    preds = {"right": y.copy(), "zero": np.zeros(6, dtype=int)}
    table = main_job_table(y, preds, lambda s: [speakers[int(v)] for v in s], true_agents,
                           groups, n_resamples=50, random_state=0)
    assert table["right"]["step"].estimate == 1.0 and table["right"]["within_1"].estimate == 1.0
    assert table["right"]["agent"].estimate == pytest.approx(5 / 6)
    assert table["zero"]["step"].estimate == pytest.approx(2 / 6)
    assert table["zero"]["within_1"].estimate == pytest.approx(4 / 6)
    for row in table.values():
        for r in row.values():
            assert r.n == 6 and r.low <= r.estimate <= r.high


# -------------------------------------------------------------------- the quickstart
def test_quickstart_runs_on_tiny_model(tmp_path, capsys):
    convs = make_conversations(30, seed=11)
    # One conversation longer than the tiny model's 512-token context: it must be
    # shortened visibly, and reported.
    rng = np.random.default_rng(0)
    words = ["alpha", "table", "query", "sum", "row", "data", "zeta", "kappa", "{", "]"]
    long_text = " ".join(rng.choice(words, size=900))
    turns = list(convs[0].turns)
    turns[1] = dataclasses.replace(turns[1], content=long_text)
    convs[0] = dataclasses.replace(convs[0], turns=tuple(turns))
    data = write_who_and_when(tmp_path / "wnw", convs)

    out = _run_quickstart(data, "100")
    text = capsys.readouterr().out

    assert out["sites"] == ["resid_pre.0", "resid_pre.1", "resid_final"]
    assert "1 of 30 exceed the 512-token context" in text
    shortened = [r for r in out["plan"] if r["chars_removed"] > 0]
    assert len(shortened) == 1 and shortened[0]["index"] == 0
    assert f"shortened 1 conversations, removing {shortened[0]['chars_removed']:,}" in text
    y = np.array([c.mistake_step for c in convs])
    for name in ("probe (skafa)", "position-only", "TF-IDF", "always step 1",
                 "most frequent step"):
        assert name in text
        steps = out["predictions"][name]
        assert steps.shape == (30,)
        assert out["table"][name]["step"].estimate == pytest.approx(np.mean(steps == y))
        assert out["table"][name]["step"].n == 30
    np.testing.assert_array_equal(out["predictions"]["always step 1"],
                                  np.minimum(1, [len(c) - 1 for c in convs]))
    # the probe is compared pairwise with the honest baselines on the same folds
    for other in ("position-only", "TF-IDF", "always step 1"):
        assert f"probe - {other}, step accuracy:" in text
        d = out["paired_all"][other]
        assert d.estimate == pytest.approx(np.mean(out["predictions"]["probe (skafa)"] == y)
                                           - np.mean(out["predictions"][other] == y))
    att = out["attribution"]
    assert f"predicted: step {att.step}" in text and "true:" in text
    assert out["attributor"].best_site_ in out["sites"]
    assert "wall times:" in text and "extraction" in out["times"]
    # anytime, by default: an interim estimate after 16 conversations (a seeded order);
    # no cache dir, so the running estimate is not written
    assert "interim estimate on 16 of 30 conversations extracted so far" in text
    assert "running estimate: not written (no --cache-dir and no --anytime-out)" in text
    assert "extraction of 30 conversations: ETA " in text and "measured/predicted" in text


def test_n_jobs_reaches_the_site_search(tmp_path):
    # SiteSelector's predictions do not depend on n_jobs (tests/model_selection)
    from skafa.benchmarks._main_job import _configured

    data = write_who_and_when(tmp_path / "wnw", make_conversations(6, seed=1))
    assert _quickstart().parse_args(["--n-jobs", "2"]).n_jobs == 2
    assert MainJobSettings(data=str(data)).n_jobs == -1
    job = prepare_main_job(MainJobSettings(data=str(data), model=MODEL, sites="stride:1",
                                           n_jobs=2))
    _, selector = _configured(job)
    assert selector.n_jobs == 2


def test_quickstart_runs_a_configuration_with_position_features(tmp_path, capsys,
                                                                 monkeypatch):
    """The main job follows skafa.configurations.RECOMMENDED, whatever its features."""
    import skafa.configurations

    monkeypatch.setattr(skafa.configurations, "RECOMMENDED", "last: softmax/top3/acts+pos")
    data = write_who_and_when(tmp_path / "wnw", make_conversations(30, seed=12))
    out = _run_quickstart(data, "50", "1", "--anytime-first", "0")  # the final figure only
    text = capsys.readouterr().out
    assert "configuration: 'last: softmax/top3/acts+pos'" in text
    select = out["attributor"].pipeline_.named_steps["select"]
    assert len(select.best_sites_) == 3 and select.best_params_["C"] in (0.01, 0.1, 1.0)
    assert any(n.startswith("pos__") for n in
               out["attributor"].pipeline_.named_steps["acts"].get_feature_names_out())
    assert out["predictions"]["probe (skafa)"].shape == (30,)


def test_quickstart_prints_a_plan_and_resumes_after_an_interrupt(model_dir, tmp_path,
                                                                 monkeypatch, capsys):
    data = write_who_and_when(tmp_path / "wnw", make_conversations(20, seed=8))
    quickstart = _quickstart()
    argv = ["--data", str(data), "--model", model_dir, "--cache-dir", str(tmp_path / "cache"),
            "--sites", "stride:2", "--n-resamples", "50"]
    put = ActivationCache.put
    calls = []

    def put_then_interrupt(self, *args, **kwargs):
        put(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(ActivationCache, "put", put_then_interrupt)
    with pytest.raises(SystemExit) as stop:
        quickstart.main(argv)
    assert stop.value.code == 130
    text = capsys.readouterr()
    assert "extraction plan: all 7 sites of 20 conversations" in text.out
    assert "20 of 20 conversations to extract (0 cached)" in text.out and "ETA" in text.out
    assert "interrupted: 3 of 20 conversations are cached" in text.out
    assert "skafa: extracting activations" in text.err  # the per-conversation progress bar
    monkeypatch.setattr(ActivationCache, "put", put)
    shared_memory_cache().clear()
    out = quickstart.main(argv)
    text = capsys.readouterr().out
    assert "17 of 20 conversations to extract (3 cached)" in text
    assert "17 forward passes" in text and "3 disk hits" in text
    assert out["predictions"]["probe (skafa)"].shape == (20,)


def test_quickstart_plan_only_prints_the_cost_and_extracts_nothing(tmp_path, capsys):
    """``--plan-only``: the reproducible command behind the README's cost figures."""
    data = write_who_and_when(tmp_path / "wnw", make_conversations(8, seed=3))
    cache = tmp_path / "cache"
    out = _quickstart().main(["--data", str(data), "--model", MODEL, "--cache-dir",
                              str(cache), "--plan-only"])
    text = capsys.readouterr().out
    est = out["estimate"]
    assert est["n_to_extract"] == 8 and est["flops_to_extract"] > 0 and est["eta_s"] > 0
    assert "TFLOP" in text and "ETA" in text
    assert "probe (skafa)" not in text  # no cross-validation
    assert not cache.exists() or not any(p.is_file() for p in cache.rglob("*"))
