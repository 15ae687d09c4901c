"""Tests for the ``skafa`` command line (skafa.cli.main), on a tiny registered model."""

import json
import os
import re

import numpy as np
import pytest

from skafa import FailureAttributor
from skafa.cli import EXIT_DATA, EXIT_INTERRUPTED, EXIT_MODEL, EXIT_OK, EXIT_USAGE, main
from skafa.llm import register_model, unregister_model
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

MODEL = "cli-tiny"


def _record(conv):
    return {"question": conv.task, "ground_truth": conv.expected_answer,
            "question_ID": conv.task_id,
            "history": [{"name": t.speaker, "role": "assistant", "content": t.content}
                        for t in conv.turns],
            "mistake_step": str(conv.mistake_step), "mistake_agent": conv.mistake_agent}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    register_model(MODEL, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    root = tmp_path_factory.mktemp("cli")
    train = root / "train.json"
    train.write_text(json.dumps([_record(c) for c in make_conversations(18, seed=2)]))
    test = root / "test.json"
    test.write_text(json.dumps([_record(c) for c in make_conversations(6, seed=4)]))
    unlabelled = root / "unlabelled.json"
    recs = [_record(c) for c in make_conversations(2, seed=4)]
    for r in recs:
        r["mistake_step"] = None
    unlabelled.write_text(json.dumps(recs))
    yield root, train, test, unlabelled
    unregister_model(MODEL)


@pytest.fixture(scope="module")
def model_dir(files):
    root, train, _, _ = files
    out = root / "probe"
    code = main(["fit", str(train), "--model", MODEL, "--sites", "resid_pre.1,resid_final",
                 "--cv", "3", "--out", str(out), "-q"])
    assert code == EXIT_OK
    return out


def test_help_is_there_for_every_command(capsys):
    assert main(["--help"]) == EXIT_OK
    out = capsys.readouterr().out
    for word in ("fit", "attribute", "report", "benchmark", "exit codes"):
        assert word in out
    for command in ("fit", "attribute", "report", "benchmark"):
        assert main([command, "--help"]) == EXIT_OK
        text = capsys.readouterr().out
        assert "DATA" in text and "example:" in text and "exit codes" in text
    assert main(["--version"]) == EXIT_OK


def test_usage_errors_exit_2(capsys):
    assert main([]) == EXIT_USAGE
    assert main(["fit"]) == EXIT_USAGE  # DATA and --out missing
    assert main(["attribute", "x", "y", "--top-k", "many"]) == EXIT_USAGE


def test_fit_saves_a_loadable_attributor(files, model_dir, capsys):
    _, train, _, _ = files
    fa = FailureAttributor.load(model_dir)
    assert fa.best_site_ in ("resid_pre.1", "resid_final") and fa.n_conversations_fit_ == 18
    # refuses to overwrite, unless told
    code = main(["fit", str(train), "--model", MODEL, "--sites", "resid_final", "--cv", "3",
                 "--out", str(model_dir), "-q"])
    assert code == EXIT_DATA and "--overwrite" in capsys.readouterr().err


def test_attribute_prints_and_writes_json(files, model_dir, tmp_path, capsys):
    _, _, test, _ = files
    out = tmp_path / "blame.json"
    assert main(["attribute", str(model_dir), str(test), "--output", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert len(rows) == 6 and "decisive turn found in" in printed
    fa = FailureAttributor.load(model_dir)
    from skafa import load_who_and_when

    convs = load_who_and_when(test).conversations
    for row, conv in zip(rows, convs):
        att = fa.attribute(conv)
        assert (row["step"], row["agent"], row["record_id"]) == (att.step, att.agent,
                                                                 conv.record_id)
        np.testing.assert_allclose(row["turn_scores"], att.turn_scores)
        assert re.search(rf"{re.escape(conv.record_id)}\s+{att.step}\s+{att.agent}", printed)


def test_report_writes_html_and_pngs(files, model_dir, tmp_path, capsys):
    _, _, test, _ = files
    html_file, png, sites = tmp_path / "r.html", tmp_path / "t.png", tmp_path / "s.png"
    code = main(["report", str(model_dir), str(test), "--record", "test/2", "--out",
                 str(html_file), "--png", str(png), "--sites-png", str(sites)])
    assert code == EXIT_OK
    page = html_file.read_text(encoding="utf-8")
    from skafa import load_who_and_when

    conv = [c for c in load_who_and_when(test).conversations if c.record_id == "test/2"][0]
    att = FailureAttributor.load(model_dir).attribute(conv)
    assert '<section class="turn blamed' in page
    assert re.search(rf'class="turn blamed[^"]*" id="turn-{att.step}"', page)
    assert png.read_bytes()[:4] == b"\x89PNG" and sites.read_bytes()[:4] == b"\x89PNG"
    assert "wrote" in capsys.readouterr().out
    # a bare id works when unique; unknown ids and indices are data errors
    assert main(["report", str(model_dir), str(test), "--record", "2", "--out",
                 str(html_file), "-q"]) == EXIT_OK
    assert main(["report", str(model_dir), str(test), "--record", "nope", "-q"]) == EXIT_DATA
    assert "no record with that id" in capsys.readouterr().err
    assert main(["report", str(model_dir), str(test), "--index", "99", "-q"]) == EXIT_DATA
    assert main(["attribute", str(model_dir), str(test), "--offset", "6", "-q"]) == EXIT_DATA
    out = tmp_path / "two.json"
    assert main(["attribute", str(model_dir), str(test), "--offset", "3", "--limit", "2", "-q",
                 "--output", str(out)]) == EXIT_OK
    assert [r["record_id"] for r in json.loads(out.read_text())] == ["test/3", "test/4"]


def test_benchmark_cross_validated_and_saved(files, model_dir, tmp_path, capsys):
    root, train, test, _ = files
    out = tmp_path / "bench.json"
    code = main(["benchmark", str(train), "--model", MODEL, "--sites", "resid_final", "--cv",
                 "2", "--folds", "3", "--n-resamples", "200", "--output", str(out), "-q"])
    assert code == EXIT_OK
    printed = capsys.readouterr().out
    assert "probe " in printed and "always step 0" in printed and "[95% CI]" in printed
    assert "lenient step acc [95% CI]" in printed      # Who&When's own scoring, named
    doc = json.loads(out.read_text())
    assert doc["n"] == 18 and len(doc["predictions"]) == 18
    hits = np.mean([p["step"] == p["true_step"] for p in doc["predictions"]])
    assert doc["results"]["probe"]["step"]["estimate"] == pytest.approx(hits)
    assert doc["results"]["probe"]["lenient_step"]["estimate"] >= hits
    code = main(["benchmark", str(test), "--attributor", str(model_dir), "--n-resamples", "200",
                 "-q"])
    assert code == EXIT_OK and "saved attributor" in capsys.readouterr().out


def test_data_and_model_errors(files, model_dir, tmp_path, capsys):
    root, train, test, unlabelled = files
    assert main(["attribute", str(model_dir), str(root / "missing.json")]) == EXIT_DATA
    assert "not found" in capsys.readouterr().err.lower()
    assert main(["fit", str(unlabelled), "--model", MODEL, "--out", str(tmp_path / "p"),
                 "-q"]) == EXIT_DATA
    assert "mistake_step" in capsys.readouterr().err
    assert main(["attribute", str(tmp_path), str(test)]) == EXIT_MODEL
    assert "cannot load the attributor" in capsys.readouterr().err
    assert main(["fit", str(train), "--model", "no-such-model-xyz", "--out",
                 str(tmp_path / "q"), "--cv", "3", "-q"]) == EXIT_MODEL
    assert main(["fit", str(train), "--model", MODEL, "--out", str(tmp_path / "r"), "--cv",
                 "30", "-q"]) == EXIT_DATA
    # a conversation longer than the tiny model's 512-token context, without shortening
    long = json.loads(test.read_text())[:1]
    long[0]["history"][0]["content"] = "word " * 3000
    long_file = tmp_path / "long.json"
    long_file.write_text(json.dumps(long))
    assert main(["attribute", str(model_dir), str(long_file), "-q"]) == EXIT_DATA
    assert "prompt tokens" in capsys.readouterr().err


def test_runs_as_a_module():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "skafa.cli", "report", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--sites-png" in done.stdout
    done = subprocess.run([sys.executable, "-m", "skafa.cli", "fit", "--bogus"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "usage: skafa fit" in done.stderr


def test_fit_with_a_preregistered_configuration(files, tmp_path, capsys):
    deep = "cli-tiny-7-layers"  # stride:3 of 7 layers: 4 sites, enough for a top-3 average
    register_model(deep, make_tiny_llama(n_layers=7), make_tiny_tokenizer(), overwrite=True)
    try:
        _fit_configured(files, tmp_path, capsys, deep)
    finally:
        unregister_model(deep)


def _fit_configured(files, tmp_path, capsys, deep):
    from skafa.configurations import RECOMMENDED, parse_configuration

    _, train, _, _ = files
    out = tmp_path / "configured"
    # no --configuration, --sites, --read or --C: the recommended configuration
    code = main(["fit", str(train), "--model", deep, "--cv", "3", "--out", str(out)])
    assert code == EXIT_OK
    fa = FailureAttributor.load(out)
    select = fa.pipeline_.named_steps["select"]
    read, _, Cs, n_sites, _ = parse_configuration(RECOMMENDED)
    assert fa.pipeline_.named_steps["acts"].read == read
    assert select.param_grid == {"C": list(Cs)} and select.cv.n_splits == 3
    assert len(fa.best_sites_) == n_sites
    assert "+".join(fa.best_sites_) in capsys.readouterr().out
    code = main(["fit", str(train), "--model", deep, "--configuration", "recommended",
                 "--cv", "3", "--out", str(tmp_path / "named"), "-q"])
    assert code == EXIT_OK
    assert FailureAttributor.load(tmp_path / "named").best_sites_ == fa.best_sites_
    # any of --sites, --read, --C: the logistic probe those describe
    code = main(["fit", str(train), "--model", deep, "--read", "last", "--cv", "3",
                 "--out", str(tmp_path / "plain"), "-q"])
    assert code == EXIT_OK
    plain = FailureAttributor.load(tmp_path / "plain").pipeline_.named_steps["select"]
    assert type(plain.estimator).__name__ == "GroupedArgmaxLogisticClassifier"
    assert type(select.estimator).__name__ != "GroupedArgmaxLogisticClassifier"
    # the configuration fixes read, sites and C; an unknown name is a usage error
    code = main(["fit", str(train), "--model", deep, "--configuration", RECOMMENDED,
                 "--C", "0.5", "--out", str(tmp_path / "x")])
    assert code == EXIT_USAGE and "drop --C" in capsys.readouterr().err
    code = main(["fit", str(train), "--model", deep, "--configuration", "last: nope",
                 "--out", str(tmp_path / "y")])
    assert code == EXIT_USAGE and "unknown configuration" in capsys.readouterr().err


def test_fit_with_stride_sites(files, tmp_path, capsys):
    _, train, _, _ = files
    out = tmp_path / "stride"
    code = main(["fit", str(train), "--model", MODEL, "--sites", "stride:1", "--cv", "3",
                 "--out", str(out), "-q"])
    assert code == EXIT_OK
    fa = FailureAttributor.load(out)
    assert fa.pipeline_.named_steps["acts"].sites_ == ("resid_pre.0", "resid_pre.1",
                                                       "resid_final")
    code = main(["fit", str(train), "--model", MODEL, "--sites", "stride:0",
                 "--out", str(tmp_path / "bad"), "-q"])
    assert code == EXIT_USAGE and "stride must be an integer >= 1" in capsys.readouterr().err


def test_fit_names_sites_the_model_lacks(files, tmp_path, capsys):
    """Sites the model does not have, or too few for the configuration, are usage errors
    (exit 2) naming the sites the model has, raised before any run is read."""
    _, train, _, _ = files
    code = main(["fit", str(train), "--model", MODEL, "--sites", "resid_pre.99,resid_final",
                 "--out", str(tmp_path / "a"), "-q"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "'resid_pre.99' (layer 99 out of range 0..1)" in err
    # the tiny model has 2 layers: stride:3 gives 2 sites, top3 needs 3
    code = main(["fit", str(train), "--model", MODEL, "--configuration",
                 "echo: softmax/top3/acts", "--out", str(tmp_path / "b"), "-q"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "unexpected" not in err
    assert "averages the 3 best sites" in err and "resid_pre.0, resid_final" in err
    assert "has only 2 of them" in err
    code = main(["benchmark", str(train), "--model", MODEL, "--configuration",
                 "echo: softmax/top3/acts", "--folds", "2", "-q"])
    assert code == EXIT_USAGE and "averages the 3 best sites" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ------------------------------------------------ bad values and paths (issue 33)
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "-inf", "abc"])
def test_C_must_be_a_positive_finite_number(files, tmp_path, capsys, value):
    """--C is checked when the command line is parsed (exit 2), not inside the CV."""
    _, train, _, _ = files
    code = main(["fit", str(train), "--model", MODEL, "--sites", "resid_final",
                 f"--C={value}", "--cv", "3", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "--C" in err and "positive" in err
    assert "unexpected" not in err and not (tmp_path / "p").exists()


def test_output_paths_are_checked_before_any_work(files, model_dir, tmp_path, capsys):
    """An --out/--output that cannot be written is exit 3 before the model or the saved
    attributor is loaded (an unknown model or folder would otherwise be exit 4)."""
    _, train, test, _ = files
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    missing = tmp_path / "no" / "such" / "folder"
    nothing = str(tmp_path / "not-a-probe")
    cases = [
        (["fit", str(train), "--model", "no-such-model-xyz", "--out", str(a_file)],
         "exists and is not a folder"),
        (["fit", str(train), "--model", "no-such-model-xyz", "--out", str(a_file / "sub")],
         "is not a folder"),
        (["attribute", nothing, str(test), "--output", str(missing / "b.json")],
         "does not exist"),
        (["attribute", nothing, str(test), "--output", str(tmp_path)], "is a folder"),
        (["report", nothing, str(test), "--out", str(missing / "r.html")], "does not exist"),
        (["report", nothing, str(test), "--png", str(a_file / "t.png")], "is not a folder"),
        (["benchmark", str(train), "--model", "no-such-model-xyz", "--output",
          str(missing / "bench.json")], "does not exist"),
    ]
    for argv, message in cases:
        assert main(argv + ["-q"]) == EXIT_DATA, argv
        err = capsys.readouterr().err
        assert message in err and "unexpected" not in err, (argv, err)
    assert not missing.parent.exists()


def test_unwritable_output_folder_is_refused_first(files, tmp_path, monkeypatch, capsys):
    _, train, test, _ = files
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere: make the folder look read-only
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: (
            False if os.path.abspath(p) == str(locked) and mode & os.W_OK else real(p, mode)))
    assert main(["attribute", str(tmp_path / "x"), str(test), "--output",
                 str(locked / "b.json"), "-q"]) == EXIT_DATA
    assert "permission denied" in capsys.readouterr().err
    assert main(["fit", str(train), "--model", "no-such-model-xyz", "--out",
                 str(locked / "sub" / "probe"), "-q"]) == EXIT_DATA
    assert f"permission denied (cannot write in {locked})" in capsys.readouterr().err


def test_configuration_error_from_the_library_is_a_usage_error(monkeypatch, capsys):
    """A ConfigurationError (e.g. n_sites above the sites compared) is exit 2, not
    'unexpected'."""
    from skafa import cli
    from skafa.exceptions import ConfigurationError

    def fit(args):
        raise ConfigurationError("n_sites=3 but only 2 sites are compared")
    monkeypatch.setitem(cli._COMMANDS, "fit", fit)
    assert main(["fit", "data.json", "--out", "p"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "only 2 sites" in err and "unexpected" not in err


def test_tilde_is_expanded_in_path_arguments(files, model_dir, tmp_path, monkeypatch,
                                             capsys):
    """'~/x' given quoted (or as --out=~/x) names the home folder, not ./~/x."""
    _, _, test, _ = files
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    (home / "runs.json").write_text(test.read_text())
    assert main(["attribute", str(model_dir), "~/runs.json", "--output", "~/blame.json",
                 "--limit", "2", "-q"]) == EXIT_OK
    assert len(json.loads((home / "blame.json").read_text())) == 2
    assert main(["report", str(model_dir), "~/runs.json", "--out=~/r.html", "-q"]) == EXIT_OK
    assert (home / "r.html").is_file()
    assert not (cwd / "~").exists()


def _mixed_records(test, n_unlabelled=2):
    """The labelled test records plus unlabelled runs: labels null, or absent."""
    records = json.loads(test.read_text())
    extra = [dict(r) for r in records[:n_unlabelled]]
    extra[0]["mistake_step"] = extra[0]["mistake_agent"] = None
    for r in extra[1:]:
        del r["mistake_step"], r["mistake_agent"]
    return records + extra


def test_attribute_blames_unlabelled_runs(files, model_dir, tmp_path, capsys):
    """New failed runs carry no label: attribute blames them; scoring skips them and
    says how many (issue 33)."""
    _, _, test, unlabelled = files
    out = tmp_path / "blame.json"
    assert main(["attribute", str(model_dir), str(unlabelled), "--output", str(out)]) \
        == EXIT_OK
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(r["true_step"] is None for r in rows)
    printed = capsys.readouterr().out
    assert "2 of 2 runs carry no label" in printed and "decisive turn found" not in printed
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps(_mixed_records(test)))
    assert main(["attribute", str(model_dir), str(mixed), "--output", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())
    hits = sum(r["step"] == r["true_step"] for r in rows[:6])
    assert f"decisive turn found in {hits} of 6 labelled runs" in printed
    assert "2 of 8 runs carry no label" in printed
    assert [r["true_step"] for r in rows[6:]] == [None, None]
    fa = FailureAttributor.load(model_dir)
    from skafa import load_who_and_when

    convs = load_who_and_when(mixed, labelled="auto").conversations
    assert [r["step"] for r in rows] == [fa.attribute(c).step for c in convs]
    # the report of an unlabelled run; benchmark scores the labelled runs only
    assert main(["report", str(model_dir), str(mixed), "--index", "7", "--out",
                 str(tmp_path / "r.html"), "-q"]) == EXIT_OK
    bench = tmp_path / "bench.json"
    assert main(["benchmark", str(mixed), "--attributor", str(model_dir), "--n-resamples",
                 "50", "--output", str(bench), "-q"]) == EXIT_OK
    assert "skipped 2 unlabelled records of 8" in capsys.readouterr().err
    assert json.loads(bench.read_text())["n"] == 6
    assert main(["benchmark", str(unlabelled), "--attributor", str(model_dir), "-q"]) \
        == EXIT_DATA
    assert "nothing to score" in capsys.readouterr().err
    # fitting needs labels: one unlabelled run is named
    assert main(["fit", str(mixed), "--model", MODEL, "--sites", "resid_final", "--out",
                 str(tmp_path / "p"), "-q"]) == EXIT_DATA
    assert "carry no mistake_step label" in capsys.readouterr().err


def test_fit_resumes_from_the_cache_after_an_interrupt(files, tmp_path, capsys):
    """Ctrl-C during extraction: exit 130 saying how to resume, nothing saved; the same
    command again reads the runs done so far from --cache-dir and finishes."""
    from skafa.llm import shared_memory_cache

    _, train, _, _ = files
    name = "cli-tiny-interrupted"
    model = make_tiny_llama(seed=5)
    calls = {"n": 0, "stop_at": 5}

    def count(module, args):
        calls["n"] += 1
        if calls["n"] == calls["stop_at"]:
            raise KeyboardInterrupt

    model.model.layers[0].register_forward_pre_hook(count)
    register_model(name, model, make_tiny_tokenizer(), overwrite=True)
    cache, out = tmp_path / "cache", tmp_path / "probe"
    argv = ["fit", str(train), "--model", name, "--sites", "resid_final", "--cv", "3",
            "--cache-dir", str(cache), "--out", str(out), "-q"]
    try:
        assert main(argv) == EXIT_INTERRUPTED
        err = capsys.readouterr().err
        assert "run the same command again to resume" in err and str(cache) in err
        assert not out.exists()
        shared_memory_cache().clear()  # a new process: only the disk cache is left
        calls.update(n=0, stop_at=None)
        assert main(argv) == EXIT_OK
        assert calls["n"] == 18 - 4  # the 4 runs read before the interrupt are cached
        assert FailureAttributor.load(out).n_conversations_fit_ == 18
        # without a cache the message says how to make a rerun resume
        calls.update(n=0, stop_at=2)
        shared_memory_cache().clear()
        assert main(argv[:-5] + ["--out", str(tmp_path / "other"), "-q"]) \
            == EXIT_INTERRUPTED
        assert "Pass --cache-dir DIR" in capsys.readouterr().err
    finally:
        unregister_model(name)
        shared_memory_cache().clear()


# ------------------------------------------------- one default everywhere (issue 31)
def _spec(value):
    """Parameters with every estimator replaced by (class, its parameters), recursively."""
    if hasattr(value, "get_params") and not isinstance(value, type):
        return (type(value).__qualname__,
                {k: _spec(v) for k, v in value.get_params(deep=False).items()})
    if hasattr(value, "split") and hasattr(value, "get_n_splits"):
        return (type(value).__qualname__, repr(value))
    if isinstance(value, dict):
        return {k: _spec(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_spec(v) for v in value)
    return value


@pytest.mark.parametrize("command", ["fit", "benchmark"])
def test_cli_default_is_failure_attributor_default(files, command):
    """Without --configuration/--sites/--read/--C, the CLI builds what FailureAttributor()
    and make_configuration(RECOMMENDED) build: equal parameters, nested ones included."""
    from skafa.cli import _make_attributor, build_parser
    from skafa.configurations import RECOMMENDED, make_configuration

    argv = [command, "data.json", "--model", MODEL, "-q"]
    if command == "fit":
        argv += ["--out", "probe"]
    cli = _make_attributor(build_parser().parse_args(argv), verbose=0)
    default = FailureAttributor(MODEL)._make_pipeline()
    extractor, selector = make_configuration(RECOMMENDED, MODEL)
    assert _spec(cli.extractor) == _spec(default.named_steps["acts"]) == _spec(extractor)
    assert _spec(cli.selector) == _spec(default.named_steps["select"]) == _spec(selector)
    # a changed knob shows: the comparison can fail
    changed = _make_attributor(build_parser().parse_args(argv + ["--shorten",
                                                                 "middle_first"]), verbose=0)
    assert _spec(changed.extractor) != _spec(extractor)
    # --shorten middle_first without a budget: the model's context length, as --help says
    assert changed.extractor.prompt.max_prompt_tokens == 512
