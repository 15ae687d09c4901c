"""Tests for the ``skafa`` command line (skafa.cli.main), on a tiny registered model."""

import json
import re

import numpy as np
import pytest

from skafa import FailureAttributor
from skafa.cli import EXIT_DATA, EXIT_MODEL, EXIT_OK, EXIT_USAGE, main
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
    # the configuration fixes read, sites and C; an unknown name is a data error
    code = main(["fit", str(train), "--model", deep, "--configuration", RECOMMENDED,
                 "--C", "0.5", "--out", str(tmp_path / "x")])
    assert code == EXIT_DATA and "drop --C" in capsys.readouterr().err
    code = main(["fit", str(train), "--model", deep, "--configuration", "last: nope",
                 "--out", str(tmp_path / "y")])
    assert code == EXIT_DATA and "unknown configuration" in capsys.readouterr().err


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
    assert code == EXIT_DATA and "stride must be an integer >= 1" in capsys.readouterr().err


def test_fit_names_sites_the_model_lacks(files, tmp_path, capsys):
    """Sites the model does not have, or too few for the configuration, are data errors."""
    _, train, _, _ = files
    code = main(["fit", str(train), "--model", MODEL, "--sites", "resid_pre.99,resid_final",
                 "--out", str(tmp_path / "a"), "-q"])
    err = capsys.readouterr().err
    assert code == EXIT_DATA and "'resid_pre.99' (layer 99 out of range 0..1)" in err
    # the tiny model has 2 layers: stride:3 gives 2 sites, top3 needs 3
    code = main(["fit", str(train), "--model", MODEL, "--configuration",
                 "echo: softmax/top3/acts", "--out", str(tmp_path / "b"), "-q"])
    err = capsys.readouterr().err
    assert code == EXIT_DATA and "unexpected" not in err
    assert "averages the 3 best sites" in err and "resid_pre.0, resid_final" in err
    code = main(["benchmark", str(train), "--model", MODEL, "--configuration",
                 "echo: softmax/top3/acts", "--folds", "2", "-q"])
    assert code == EXIT_DATA and "averages the 3 best sites" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
