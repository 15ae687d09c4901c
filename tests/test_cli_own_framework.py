"""Your own framework on the command line: trace formats, labels side files, the
labelling loop in a real terminal (tmux), the learning curve, the shift mark."""

import json
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from skafa.cli import EXIT_DATA, EXIT_OK, EXIT_USAGE, main
from skafa.exceptions import ConversationError
from skafa.integrations.files import detect_format, read_runs
from skafa.labelling import read_labels, write_labels
from skafa.llm import register_model, unregister_model
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

MODEL = "cli-own-tiny"


def _langgraph(conv):
    return [{"type": "human", "content": conv.task}] + [
        {"type": "ai", "name": t.speaker, "content": t.content} for t in conv.turns]


def _autogen(conv):
    return {"messages": [{"source": t.speaker, "type": "TextMessage", "content": t.content}
                         for t in conv.turns]}


def _record(conv, labelled=True):
    return {"question": conv.task, "ground_truth": conv.expected_answer,
            "question_ID": conv.task_id,
            "history": [{"name": t.speaker, "role": "assistant", "content": t.content}
                        for t in conv.turns],
            "mistake_step": str(conv.mistake_step) if labelled else None,
            "mistake_agent": conv.mistake_agent if labelled else None}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("traces")
    convs = make_conversations(16, min_turns=3, max_turns=6, seed=11)
    (root / "lg").mkdir()
    for i, c in enumerate(convs):
        (root / "lg" / f"run{i:02d}.json").write_text(json.dumps(_langgraph(c)))
    (root / "ag").mkdir()
    for i, c in enumerate(convs[:3]):
        (root / "ag" / f"run{i}.json").write_text(json.dumps(_autogen(c)))
    labels = {f"run{i:02d}": {"mistake_step": c.mistake_step + 1,  # +1: the task turn
                              "mistake_agent": c.mistake_agent}
              for i, c in enumerate(convs)}
    write_labels(root / "labels.json", labels)
    return root, convs


def test_trace_folders_load_in_every_format(traces):
    root, convs = traces
    runs = read_runs(root / "lg")
    assert len(runs) == 16 and runs[0].record_id == "run00"
    assert all(r.mistake_step is None for r in runs)  # traces carry no labels
    assert runs[0].task_id == "run00"  # each run its own task when the trace names none
    ag = read_runs(root / "ag", format="autogen")
    assert [len(r) for r in ag] == [len(c) for c in convs[:3]]
    assert detect_format(_langgraph(convs[0])) == "langgraph"
    with pytest.raises(ConversationError, match="format not recognised"):
        (root / "odd").mkdir(exist_ok=True)
        (root / "odd" / "x.json").write_text('{"foo": 1}')
        read_runs(root / "odd")
    (root / "nan").mkdir(exist_ok=True)
    (root / "nan" / "bad.json").write_text('[{"type": "ai", "content": NaN}]')
    with pytest.raises(ConversationError, match=r"bad.json.*NaN"):
        read_runs(root / "nan")


@pytest.fixture(scope="module")
def tiny_model():
    register_model(MODEL, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    yield MODEL
    unregister_model(MODEL)


def test_fit_and_attribute_on_traces_with_a_labels_file(traces, tiny_model, tmp_path,
                                                        capsys):
    root, _ = traces
    out = tmp_path / "probe"
    code = main(["fit", str(root / "lg"), "--labels", str(root / "labels.json"),
                 "--model", MODEL, "--sites", "resid_pre.1,resid_final", "--cv", "3",
                 "--out", str(out), "-q"])
    assert code == EXIT_OK, capsys.readouterr().err
    assert "16 of 16 runs labelled from" in capsys.readouterr().err
    # without labels, fit refuses and names a record
    assert main(["fit", str(root / "lg"), "--model", MODEL, "--out",
                 str(tmp_path / "p2"), "-q"]) == EXIT_DATA
    assert "run00" in capsys.readouterr().err
    code = main(["attribute", str(out), str(root / "ag"), "--format", "autogen",
                 "--output", str(tmp_path / "blame.json")])
    assert code == EXIT_OK
    rows = json.loads((tmp_path / "blame.json").read_text())
    assert [r["record_id"] for r in rows] == ["run0", "run1", "run2"]
    assert all(isinstance(r["shifted"], bool) for r in rows)


def test_learning_curve_command(traces, tiny_model, tmp_path, capsys):
    root, _ = traces
    code = main(["learning-curve", str(root / "lg"), "--labels", str(root / "labels.json"),
                 "--model", MODEL, "--sites", "resid_pre.1,resid_final", "--cv", "2",
                 "--sizes", "6,all", "--n-draws", "2", "--folds", "2", "--n-resamples",
                 "50", "--output", str(tmp_path / "c.json"), "--png",
                 str(tmp_path / "c.png"), "-q"])
    assert code == EXIT_OK, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "step accuracy [95% CI]" in out and "all" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert len(data["rows"]) == 2 and data["n_runs"] == 16
    assert (tmp_path / "c.png").stat().st_size > 0
    assert main(["learning-curve", str(root / "lg"), "--labels", str(root / "labels.json"),
                 "--model", MODEL, "--sizes", "0,5"]) == EXIT_USAGE
    assert "--sizes 0 needs --source" in capsys.readouterr().err
    assert main(["learning-curve", str(root / "lg"), "--model", MODEL,
                 "--sizes", "five"]) == EXIT_USAGE


def test_label_and_learning_curve_answer_help(capsys):
    for command in ("label", "learning-curve"):
        assert main([command, "--help"]) == EXIT_OK
        assert "usage: skafa " + command in capsys.readouterr().out


# ------------------------------------------------------------- the loop in a terminal
def _tmux(session, *args):
    """tmux on a server of this session's own (``-L``): a session ending (and its server
    with it) never races the start of the next one."""
    done = subprocess.run(["tmux", "-L", session, *args], capture_output=True, text=True)
    if done.returncode:
        raise AssertionError(f"tmux {' '.join(args[:3])} failed ({done.returncode}): "
                             f"{done.stderr.strip()}")
    return done


def _wait_for(session, text, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        pane = _tmux(session, "capture-pane", "-p", "-S", "-200", "-t", session).stdout
        if text in pane:
            return pane
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared; the pane shows:\n{pane}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_label_loop_in_a_real_terminal_resumes_after_ctrl_c(tmp_path):
    convs = make_conversations(3, min_turns=4, max_turns=5, seed=3)
    data = tmp_path / "runs.json"
    data.write_text(json.dumps([_record(c, labelled=False) for c in convs]))
    out = tmp_path / "labels.json"
    session = f"skafa-{uuid.uuid4().hex[:8]}"
    cmd = f"{sys.executable} -m skafa.cli label {data} --out {out} --page-turns 2"
    _tmux(session, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd + "; sleep 30")
    try:
        _wait_for(session, "decisive step (number)")
        _tmux(session, "send-keys", "-t", session, "99", "Enter")  # out of range: asked again
        _wait_for(session, "step 99 is out of range")
        _tmux(session, "send-keys", "-t", session, "1", "Enter")
        _wait_for(session, "responsible agent")
        _tmux(session, "send-keys", "-t", session, "nobody", "Enter")  # unknown agent: asked again
        _wait_for(session, "unknown agent 'nobody'")
        _tmux(session, "send-keys", "-t", session, "Enter")  # the speaker of turn 1
        _wait_for(session, "=== run 2/3")
        _tmux(session, "send-keys", "-t", session, "C-c")  # stop: the first answer is kept
        _wait_for(session, "run the same command to resume")
    finally:
        subprocess.run(["tmux", "-L", session, "kill-server"], capture_output=True)
    labels = read_labels(out)
    first = convs[0]
    assert list(labels) == ["runs/0"]  # the record id the reader gives the first record
    lab = labels["runs/0"]
    assert lab == {"mistake_step": 1, "mistake_agent": first.turns[1].speaker}
    # the same command resumes with the two runs left
    session = f"skafa-{uuid.uuid4().hex[:8]}"
    _tmux(session, "new-session", "-d", "-s", session, "-x", "200", "-y", "50", cmd + "; sleep 30")
    try:
        pane = _wait_for(session, "decisive step (number)")
        assert "2 run(s) to label (1 already labelled)" in pane
        _tmux(session, "send-keys", "-t", session, "q", "Enter")
        _wait_for(session, "stopped: 1 label(s)")
    finally:
        subprocess.run(["tmux", "-L", session, "kill-server"], capture_output=True)
    assert list(read_labels(out)) == ["runs/0"]


# ------------------------------------------------------- converted models, reused
def test_every_command_keeps_converted_models_where_the_next_call_finds_them(
        tmp_path, monkeypatch):
    import os

    from skafa import cli

    seen = {}

    def spy(args):
        seen["dir"] = os.environ.get("SKAFA_CONVERT_DIR")
        return EXIT_OK

    monkeypatch.delenv("SKAFA_CONVERT_DIR", raising=False)
    monkeypatch.setitem(cli._COMMANDS, "label", spy)
    assert main(["label", str(tmp_path), "--out", str(tmp_path / "l.json"),
                 "--format", "langgraph"]) == EXIT_OK
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert main(["label", str(tmp_path), "--out", str(tmp_path / "l.json")]) == EXIT_OK
    assert seen["dir"] == str(tmp_path / "xdg" / "skafa" / "models")
    assert "SKAFA_CONVERT_DIR" not in os.environ  # restored after main()
    monkeypatch.setitem(cli._COMMANDS, "fit", spy)
    assert main(["fit", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--out",
                 str(tmp_path / "p")]) == EXIT_OK
    assert seen["dir"] == str(tmp_path / "c" / "models")
    monkeypatch.setenv("SKAFA_CONVERT_DIR", str(tmp_path / "mine"))
    assert main(["fit", str(tmp_path), "--cache-dir", str(tmp_path / "c"), "--out",
                 str(tmp_path / "p")]) == EXIT_OK
    assert seen["dir"] == str(tmp_path / "mine")


def test_load_model_takes_the_convert_dir_from_the_environment(tmp_path, monkeypatch):
    from skafa.llm import _models, clear_model_cache, load_model

    got = {}

    def fake_load(spec, tok_source, dtype_name, device_name, trust, convert_dir=None):
        got["convert_dir"] = convert_dir
        raise RuntimeError("stop here")

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setattr(_models, "_load", fake_load)
    monkeypatch.setenv("SKAFA_CONVERT_DIR", str(tmp_path / "conv"))
    clear_model_cache()
    with pytest.raises(RuntimeError, match="stop here"):
        load_model(str(gguf))
    assert str(got["convert_dir"]) == str(tmp_path / "conv")
    monkeypatch.setenv("SKAFA_CONVERT_DIR", "")
    with pytest.raises(RuntimeError, match="stop here"):
        load_model(str(gguf))
    assert got["convert_dir"] is None


def test_fit_adapts_to_unlabelled_target_runs(traces, tiny_model, tmp_path, capsys):
    from skafa import FailureAttributor

    root, _ = traces
    out = tmp_path / "adapted"
    code = main(["fit", str(root / "lg"), "--labels", str(root / "labels.json"),
                 "--target-runs", str(root / "ag"), "--model", MODEL, "--sites",
                 "resid_pre.1,resid_final", "--cv", "3", "--out", str(out)])
    assert code == EXIT_OK, capsys.readouterr().err
    assert "adapting to 3 unlabelled runs" in capsys.readouterr().err
    fa = FailureAttributor.load(out)
    assert [n for n, _ in fa.pipeline_.steps] == ["acts", "adapt", "select"]


def test_a_sigterm_stop_exits_143(monkeypatch, capsys):
    import signal

    from skafa import cli
    from skafa.exceptions import StopRequested

    def stopped(args):
        raise StopRequested(signal.SIGTERM, "reading runs")

    monkeypatch.setitem(cli._COMMANDS, "label", stopped)
    assert main(["label", "x", "--out", "y.json"]) == 143
    assert "stopped by a signal" in capsys.readouterr().err
