"""The labelling loop, driven through its read/write hooks; its files; resuming."""

import json

import pytest

from skafa.labelling import apply_labels, label_runs, read_labels, write_labels
from skafa.testing import make_conversations


def _runs(n=3):
    import dataclasses

    return [dataclasses.replace(c, record_id=f"fw/{i}", mistake_step=None,
                                mistake_agent=None)
            for i, c in enumerate(make_conversations(n, min_turns=4, max_turns=6, seed=1))]


def _driver(answers):
    answers = list(answers)
    out = []

    def read():
        if not answers:
            raise EOFError
        a = answers.pop(0)
        if a is KeyboardInterrupt:
            raise KeyboardInterrupt
        return a

    return read, out.append, out


def test_labels_every_run_and_writes_who_and_when_fields(tmp_path):
    runs = _runs(2)
    path = tmp_path / "labels.json"
    agent1 = runs[1].turns[1].speaker
    read, write, out = _driver(["2", "", "1", agent1])
    summary = label_runs(runs, path, read=read, write=write)
    assert summary == {"labelled": 2, "skipped": 0, "total_in_file": 2, "stopped": False}
    data = json.loads(path.read_text())
    assert data["format"] == "skafa-labels"
    assert data["labels"]["fw/0"] == {"mistake_step": 2,
                                      "mistake_agent": runs[0].turns[2].speaker}
    assert data["labels"]["fw/1"] == {"mistake_step": 1, "mistake_agent": agent1}
    labelled, n = apply_labels(runs, read_labels(path))
    assert n == 2 and [c.mistake_step for c in labelled] == [2, 1]


def test_out_of_range_step_and_unknown_agent_are_asked_again(tmp_path):
    runs = _runs(1)
    read, write, out = _driver(["99", "abc", "1", "nobody", ""])
    label_runs(runs, tmp_path / "l.json", read=read, write=write)
    text = "".join(out)
    assert "step 99 is out of range: this run has turns 0 to" in text
    assert "'abc' is not a step" in text
    assert "unknown agent 'nobody'" in text
    assert read_labels(tmp_path / "l.json")["fw/0"]["mistake_step"] == 1


def test_ctrl_c_keeps_answers_and_the_same_call_resumes(tmp_path):
    runs = _runs(3)
    path = tmp_path / "l.json"
    read, write, out = _driver(["0", "", KeyboardInterrupt])
    s = label_runs(runs, path, read=read, write=write)
    assert s["stopped"] and s["total_in_file"] == 1
    assert "run the same command to resume" in "".join(out)
    read, write, out = _driver(["s", "3", ""])
    s = label_runs(runs, path, read=read, write=write)
    assert "2 run(s) to label (1 already labelled)" in "".join(out)
    assert s == {"labelled": 1, "skipped": 1, "total_in_file": 2, "stopped": False}
    assert set(read_labels(path)) == {"fw/0", "fw/2"}


def test_paging_folding_and_open(tmp_path):
    import dataclasses

    from skafa import Turn

    run = _runs(1)[0]
    long = Turn(speaker=run.turns[0].speaker, content="x" * 1000)
    run = dataclasses.replace(run, turns=(long, *run.turns[1:]))
    read, write, out = _driver(["n", "p", "o 0", "q"])
    label_runs([run], tmp_path / "l.json", page_turns=2, fold=50, read=read, write=write)
    text = "".join(out)
    assert "(+950 characters; 'o N' shows all)" in text
    assert "page 2/" in text and "x" * 1000 in text
    assert not (tmp_path / "l.json").exists()


def test_labels_file_is_validated(tmp_path):
    p = tmp_path / "l.json"
    assert read_labels(p) == {}
    p.write_text('{"format": "skafa-labels", "version": 1, "labels": '
                 '{"a": {"mistake_step": NaN, "mistake_agent": "x"}}}')
    with pytest.raises(ValueError, match="NaN"):
        read_labels(p)
    write_labels(p, {"a": {"mistake_step": -1, "mistake_agent": "x"}})
    with pytest.raises(ValueError, match=r"labels\['a'\].mistake_step=-1"):
        read_labels(p)
    write_labels(p, {"a": {"mistake_step": 1, "mistake_agent": " "}})
    with pytest.raises(ValueError, match="mistake_agent"):
        read_labels(p)
    p.write_text("[]")
    with pytest.raises(ValueError, match="not a labels file"):
        read_labels(p)
    write_labels(p, {"fw/0": {"mistake_step": 50, "mistake_agent": "x"}})
    with pytest.raises(ValueError, match="outside its"):
        apply_labels(_runs(1), read_labels(p), source=str(p))
