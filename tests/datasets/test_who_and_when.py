"""Tests for skafa.datasets._who_and_when: load_who_and_when, fetch_who_and_when and helpers."""

import json
import os
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest

from skafa.conversation import Conversation, ConversationError
from skafa.datasets import (
    SUBSETS,
    fetch_who_and_when,
    get_data_home,
    load_who_and_when,
    who_and_when_path,
)

AG, HC = SUBSETS


def _record(n_turns=3, step=1, task="t1", hand=False, agent=None):
    if hand:
        history = [{"content": f"turn {i}", "role": "WebSurfer" if i % 2 else
                    "Orchestrator (thought)"} for i in range(n_turns)]
    else:
        history = [{"content": f"turn {i}", "role": "assistant", "name": f"Expert_{i % 2}"}
                   for i in range(n_turns)]
    speaker = history[step].get("name") or history[step]["role"]
    return {
        "question": f"question of {task}",
        "ground_truth": "42",
        "question_ID": task,
        "history": history,
        "mistake_step": str(step),
        "mistake_agent": agent or speaker,
        "mistake_reason": "because",
    }


def _write(path: Path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) if not isinstance(data, str) else data, encoding="utf-8")
    return path


def _fake_dataset(root: Path, ag_ids=(1, 2, 10, 9), hc_ids=(3, 1)):
    for i in ag_ids:
        _write(root / AG / f"{i}.json", _record(step=i % 3, task=f"task{i}"))
    for i in hc_ids:
        _write(root / HC / f"{i}.json", _record(n_turns=4, step=3, task=f"task{i}", hand=True))
    return root


# ------------------------------------------------------------- shared data set
def _raw(who_and_when_dir, subset):
    files = sorted((who_and_when_dir / subset).glob("*.json"), key=lambda p: int(p.stem))
    return files, [json.loads(f.read_text(encoding="utf-8")) for f in files]


def test_load_all_shared_records(who_and_when_dir):
    data = load_who_and_when(who_and_when_dir)
    ag_files, ag_raw = _raw(who_and_when_dir, AG)
    hc_files, hc_raw = _raw(who_and_when_dir, HC)
    n = len(ag_files) + len(hc_files)
    if who_and_when_dir.resolve() == (Path(__file__).resolve().parents[2] / "shared" / "data"
                                      / "who_and_when"):
        assert (len(ag_files), len(hc_files)) == (100, 30)  # the workplace's subset
    assert len(data.conversations) == n == len(data.mistake_steps) == len(data.record_ids)
    assert data.skipped == []
    assert data.subsets.tolist() == [AG] * len(ag_files) + [HC] * len(hc_files)
    assert data.record_ids.tolist() == [f"{AG}/{f.stem}" for f in ag_files] + [
        f"{HC}/{f.stem}" for f in hc_files]
    assert data.mistake_steps.dtype == np.int64
    for conv, step, raw in zip(data.conversations, data.mistake_steps, ag_raw + hc_raw):
        assert isinstance(conv, Conversation)
        assert isinstance(conv.mistake_step, int) and conv.mistake_step == step
        assert 0 <= step < len(conv) == len(raw["history"])
        assert step == int(raw["mistake_step"])
        assert conv.task_id == raw["question_ID"]
        assert conv.mistake_agent == raw["mistake_agent"]
    assert data.task_ids.tolist() == [c.task_id for c in data.conversations]
    assert data.mistake_agents.tolist() == [c.mistake_agent for c in data.conversations]
    assert f"{len(ag_files)} {AG}" in data.DESCR and "ICML 2025" in data.DESCR
    assert data.path == str(who_and_when_dir)


def test_hand_crafted_speakers_are_real_names(who_and_when_dir):
    data = load_who_and_when(who_and_when_dir, subset=HC)
    _, raw = _raw(who_and_when_dir, HC)
    speakers = set()
    for conv, record in zip(data.conversations, raw):
        assert conv.speakers == tuple(m["role"] for m in record["history"])
        speakers.update(conv.speakers)
    assert {"WebSurfer", "Orchestrator (thought)"} <= speakers
    assert not {s for s in speakers if s.strip().casefold() in {"unknown", "none", ""}}


def test_algorithm_generated_speakers_are_names(who_and_when_dir):
    data = load_who_and_when(who_and_when_dir, subset="algorithm")
    _, raw = _raw(who_and_when_dir, AG)
    for conv, record in zip(data.conversations, raw):
        assert conv.speakers == tuple(m["name"] for m in record["history"])
    assert "Computer_terminal" in {s for c in data.conversations for s in c.speakers}


def test_annotated_agent_vs_speaker_of_decisive_turn(who_and_when_dir):
    from skafa.metrics import agent_accuracy

    data = load_who_and_when(who_and_when_dir)
    speakers = [c.mistake_speaker for c in data.conversations]
    rates = [agent_accuracy(data.mistake_agents, speakers, rule=r)
             for r in ("exact", "normalized", "substring")]
    assert rates[0] < 1.0  # the annotation is not always the speaker: rules matter
    if len(data.conversations) == 110:  # the workplace's development subset
        assert rates == pytest.approx([105 / 110, 106 / 110, 107 / 110])


def test_shared_order_is_deterministic_and_numeric(who_and_when_dir):
    a = load_who_and_when(who_and_when_dir)
    b = load_who_and_when(who_and_when_dir)
    assert a.record_ids.tolist() == b.record_ids.tolist()
    assert a.conversations == b.conversations
    for subset in SUBSETS:
        ids = [int(r.split("/")[1]) for r in a.record_ids if r.startswith(subset)]
        assert ids == sorted(ids)


def test_shared_subsets_and_return_X_y(who_and_when_dir):
    full = load_who_and_when(who_and_when_dir)
    hand = load_who_and_when(who_and_when_dir, subset="hand")
    algo = load_who_and_when(who_and_when_dir / AG)  # one subset folder
    assert set(hand.subsets) == {HC} and set(algo.subsets) == {AG}
    assert algo.conversations + hand.conversations == full.conversations
    X, y, groups = load_who_and_when(who_and_when_dir, return_X_y=True)
    assert X == full.conversations
    np.testing.assert_array_equal(y, full.mistake_steps)
    np.testing.assert_array_equal(groups, full.task_ids)


# ------------------------------------------------------------- synthetic folders
def test_order_by_subset_then_numeric_id(tmp_path):
    root = _fake_dataset(tmp_path / "ww")
    _write(root / AG / "abc.json", _record(task="named"))
    _write(root / AG / "README.md", "not a record")
    _write(root / AG / ".5.json", "{ broken")  # hidden files are ignored
    data = load_who_and_when(root)
    assert data.record_ids.tolist() == [f"{AG}/1", f"{AG}/2", f"{AG}/9", f"{AG}/10",
                                        f"{AG}/abc", f"{HC}/1", f"{HC}/3"]
    assert data.mistake_steps.tolist() == [1, 2, 0, 1, 1, 3, 3]
    assert data.conversations[0].record_id == f"{AG}/1"
    assert data.conversations[-1].speakers[0] == "Orchestrator (thought)"


@pytest.mark.parametrize("alias, expected", [
    ("Algorithm-Generated", AG), ("algorithm", AG), ("ALGORITHM", AG), (" hand ", HC),
    ("Hand-Crafted", HC), ("hand_crafted", HC), (None, None),
])
def test_subset_aliases(tmp_path, alias, expected):
    data = load_who_and_when(_fake_dataset(tmp_path), subset=alias)
    assert set(data.subsets) == ({AG, HC} if expected is None else {expected})


def test_subset_and_path_errors(tmp_path):
    root = _fake_dataset(tmp_path / "ww", hc_ids=())
    with pytest.raises(ValueError, match="unknown subset 'both'"):
        load_who_and_when(root, subset="both")
    with pytest.raises(TypeError, match="subset must be a string"):
        load_who_and_when(root, subset=1)
    with pytest.raises(FileNotFoundError, match="subset 'Hand-Crafted' not found"):
        load_who_and_when(root, subset="hand")
    with pytest.raises(FileNotFoundError, match="is not the 'Hand-Crafted' folder"):
        load_who_and_when(root / AG, subset="hand")
    with pytest.raises(FileNotFoundError, match="SKAFA_WHO_AND_WHEN.*fetch_who_and_when"):
        load_who_and_when(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.json record files"):
        load_who_and_when(tmp_path / "empty")
    # Only one subset present: subset=None loads it.
    assert set(load_who_and_when(root).subsets) == {AG}


def test_plain_folder_of_records(tmp_path):
    folder = tmp_path / "my_runs"
    _write(folder / "7.json", _record(task="x"))
    data = load_who_and_when(folder)
    assert data.record_ids.tolist() == ["my_runs/7"] and data.subsets.tolist() == ["my_runs"]


def test_single_json_list_file(tmp_path):
    records = [_record(task="a"), _record(step=2, task="b", hand=True)]
    path = _write(tmp_path / "hand-crafted.json", records)
    data = load_who_and_when(path)
    assert data.record_ids.tolist() == [f"{HC}/0", f"{HC}/1"]
    assert data.mistake_steps.tolist() == [1, 2]
    assert load_who_and_when(path, subset="hand").task_ids.tolist() == ["a", "b"]
    with pytest.raises(ValueError, match="single file.*subset=None"):
        load_who_and_when(path, subset="algorithm")
    other = _write(tmp_path / "runs.json", records)
    assert load_who_and_when(other).record_ids.tolist() == ["runs/0", "runs/1"]
    single = _write(tmp_path / "one.json", _record(task="solo"))
    assert load_who_and_when(single).task_ids.tolist() == ["solo"]
    X, y, groups = load_who_and_when(other, return_X_y=True)
    assert len(X) == 2 and y.tolist() == [1, 2] and groups.tolist() == ["a", "b"]


def test_single_file_errors(tmp_path):
    with pytest.raises(ValueError, match="list of records is empty"):
        load_who_and_when(_write(tmp_path / "empty.json", []))
    with pytest.raises(ConversationError, match="expected a JSON list of records"):
        load_who_and_when(_write(tmp_path / "number.json", "3"))
    broken = _write(tmp_path / "broken.json", "[{")
    for strict in (True, False):
        with pytest.raises(ConversationError, match="broken.json: not valid JSON"):
            load_who_and_when(broken, strict=strict)
    bad = _write(tmp_path / "mixed.json", [_record(), {"question": "q"}])
    with pytest.raises(ConversationError, match=r"mixed.json\[1\].*missing required"):
        load_who_and_when(bad)
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        data = load_who_and_when(bad, strict=False)
    assert len(data.conversations) == 1 and data.skipped[0][0].endswith("mixed.json[1]")


@pytest.mark.parametrize(
    "content, message",
    [
        ("{ not json", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not UTF-8|not valid JSON"),
        ({"question": "q", "history": []}, "missing required field"),
        (dict(_record(), mistake_step="7"), "outside the history"),
        (dict(_record(), mistake_step="one"), "is not an integer"),
        (dict(_record(), history=[{"content": None, "role": "a"}], mistake_step="0"),
         r"history\[0\]\.content must be text"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_file_error_names_file(tmp_path, content, message):
    root = _fake_dataset(tmp_path / "ww")
    bad = root / AG / "5.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        _write(bad, content)
    with pytest.raises(ConversationError, match=message) as info:
        load_who_and_when(root)
    assert str(bad) in str(info.value)
    assert "strict=False" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_strict_false_skips_and_reports_every_file(tmp_path):
    root = _fake_dataset(tmp_path / "ww")
    bad1 = _write(root / AG / "5.json", "{ not json")
    bad2 = _write(root / HC / "8.json", dict(_record(), mistake_step="99"))
    with pytest.warns(UserWarning, match="skipped 2 malformed Who&When record") as record:
        data = load_who_and_when(root, strict=False)
    assert str(bad1) in str(record[0].message) and str(bad2) in str(record[0].message)
    assert [f for f, _ in data.skipped] == [str(bad1), str(bad2)]
    assert "not valid JSON" in data.skipped[0][1]
    assert "outside the history" in data.skipped[1][1]
    assert len(data.conversations) == 6
    assert f"{AG}/5" not in data.record_ids.tolist()
    assert "2 skipped" in data.DESCR


def test_strict_false_all_malformed_raises(tmp_path):
    folder = tmp_path / AG
    _write(folder / "1.json", "{")
    _write(folder / "2.json", {"question": "q"})
    with pytest.warns(UserWarning, match="skipped 2"):
        with pytest.raises(ValueError, match="all 2 were malformed"):
            load_who_and_when(folder, strict=False)


def test_verbose_prints(tmp_path, capsys):
    root = _fake_dataset(tmp_path / "ww")
    _write(root / HC / "9.json", "{")
    with pytest.warns(UserWarning):
        load_who_and_when(root, strict=False, verbose=2)
    out = capsys.readouterr().out
    assert f"{AG}: 4 records" in out and f"{HC}: 2 records" in out and "(1 skipped)" in out
    assert "skipped " in out and "9.json" in out


def test_default_path_from_environment(tmp_path, monkeypatch):
    root = _fake_dataset(tmp_path / "ww")
    monkeypatch.setenv("SKAFA_WHO_AND_WHEN", str(root))
    assert who_and_when_path() == root
    assert len(load_who_and_when().conversations) == 6
    monkeypatch.delenv("SKAFA_WHO_AND_WHEN")
    monkeypatch.setenv("SKAFA_DATA", str(tmp_path / "home"))
    assert who_and_when_path() == tmp_path / "home" / "who_and_when"
    with pytest.raises(FileNotFoundError, match="fetch_who_and_when"):
        load_who_and_when()
    _fake_dataset(tmp_path / "home" / "who_and_when")
    assert len(load_who_and_when().conversations) == 6


def test_get_data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SKAFA_DATA", str(tmp_path / "a" / "b"))
    home = get_data_home()
    assert home == tmp_path / "a" / "b" and home.is_dir()
    assert get_data_home(tmp_path / "c") == tmp_path / "c"
    monkeypatch.delenv("SKAFA_DATA")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert get_data_home() == tmp_path / "user" / "skafa_data"


# ------------------------------------------------------------------ fetching
@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def test_fetch_offline_missing_raises(tmp_path, no_network):
    with pytest.raises(OSError, match=r"download_if_missing=False.*load_who_and_when\(path\)"):
        fetch_who_and_when(tmp_path / "home", download_if_missing=False)
    _fake_dataset(tmp_path / "home" / "who_and_when", hc_ids=())
    with pytest.raises(OSError, match="Hand-Crafted"):
        fetch_who_and_when(tmp_path / "home", download_if_missing=False)


def test_fetch_present_folder_loads_without_network(tmp_path, no_network):
    _fake_dataset(tmp_path / "home" / "who_and_when")
    data = fetch_who_and_when(tmp_path / "home")
    assert len(data.conversations) == 6 and set(data.subsets) == {AG, HC}
    X, y, groups = fetch_who_and_when(tmp_path / "home", subset="hand", return_X_y=True,
                                      download_if_missing=False)
    assert len(X) == 2 and y.tolist() == [3, 3]


def test_fetch_present_subset_only(tmp_path, no_network, monkeypatch):
    _fake_dataset(tmp_path / "home" / "who_and_when", ag_ids=())
    monkeypatch.setenv("SKAFA_DATA", str(tmp_path / "home"))
    assert set(fetch_who_and_when(subset="hand").subsets) == {HC}


def _archive(tmp_path, *, with_hand=True, extra=()):
    path = tmp_path / "archive.zip"
    top = "Agents_Failure_Attribution-main/Who&When"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{top}/", "")
        zf.writestr("Agents_Failure_Attribution-main/README.md", "readme")
        zf.writestr(f"{top}/Algorithm-Generated/1.json", json.dumps(_record(task="z1")))
        zf.writestr(f"{top}/Algorithm-Generated/12.json", json.dumps(_record(task="z12")))
        if with_hand:
            zf.writestr(f"{top}/Hand-Crafted/4.json",
                        json.dumps(_record(n_turns=5, step=4, hand=True, task="h4")))
        for name, text in extra:
            zf.writestr(name, text)
    return path


def test_fetch_downloads_from_file_url(tmp_path):
    evil = [
        ("Agents_Failure_Attribution-main/Who&When/Hand-Crafted/../../evil.json", "{}"),
        ("Who&When/../evil2.json", "{}"),
        ("Agents_Failure_Attribution-main/Who&When/Hand-Crafted/notes.txt", "x"),
        ("Agents_Failure_Attribution-main/Who&When/Other/1.json", "{}"),
    ]
    url = _archive(tmp_path, extra=evil).as_uri()
    home = tmp_path / "home"
    data = fetch_who_and_when(home, url=url)
    assert data.record_ids.tolist() == [f"{AG}/1", f"{AG}/12", f"{HC}/4"]
    assert data.mistake_steps.tolist() == [1, 1, 4]
    folder = home / "who_and_when"
    assert sorted(p.name for p in folder.iterdir()) == [AG, HC]
    assert sorted(p.name for p in (folder / HC).iterdir()) == ["4.json"]
    assert sorted(p.name for p in home.iterdir()) == ["who_and_when"]  # temp files removed
    assert not list(tmp_path.rglob("evil*.json"))


def test_fetch_keeps_existing_subset_folders(tmp_path):
    home = tmp_path / "home"
    _fake_dataset(home / "who_and_when", ag_ids=())  # Hand-Crafted only, ids 3 and 1
    (home / "who_and_when" / AG).mkdir()  # an empty leftover folder gets filled
    data = fetch_who_and_when(home, url=_archive(tmp_path).as_uri(), verbose=1)
    assert data.record_ids.tolist() == [f"{AG}/1", f"{AG}/12", f"{HC}/1", f"{HC}/3"]


@pytest.mark.parametrize("case", ["missing", "not_zip", "no_hand"])
def test_fetch_download_failures(tmp_path, case):
    if case == "missing":
        url, message = (tmp_path / "nope.zip").as_uri(), "could not download"
    elif case == "not_zip":
        url, message = _write(tmp_path / "a.zip", "plain text").as_uri(), "not a zip archive"
    else:
        url, message = _archive(tmp_path, with_hand=False).as_uri(), "Hand-Crafted"
    home = tmp_path / "home"
    with pytest.raises(OSError, match=message) as info:
        fetch_who_and_when(home, url=url)
    assert "load_who_and_when(path)" in str(info.value)
    assert not (home / "who_and_when").exists()
    assert os.listdir(home) == []  # nothing half-written is left behind


def test_fetch_only_requested_subset_needs_to_exist(tmp_path):
    url = _archive(tmp_path, with_hand=False).as_uri()
    data = fetch_who_and_when(tmp_path / "home", subset="algorithm", url=url)
    assert set(data.subsets) == {AG}


# --------------------------------------------------- bad and unlabelled records
def _named_record(**changes):
    record = {
        "question": "What is 2 + 2?", "ground_truth": "4", "question_ID": "q1",
        "history": [{"name": "a", "role": "assistant", "content": "x"},
                    {"name": "b", "role": "assistant", "content": "y"}],
        "mistake_step": "1", "mistake_agent": "b",
    }
    record.update(changes)
    return {k: v for k, v in record.items() if v is not ...}


def test_loader_names_and_counts_records_without_question_id(tmp_path):
    from skafa.datasets import load_who_and_when

    folder = tmp_path / "Algorithm-Generated"
    folder.mkdir()
    (folder / "1.json").write_text(json.dumps(_named_record()))
    (folder / "2.json").write_text(json.dumps(_named_record(question_ID=...)))
    with pytest.raises(ConversationError, match=r"2\.json.*question_ID"):
        load_who_and_when(tmp_path)
    with pytest.warns(UserWarning, match="skipped 1"):
        data = load_who_and_when(tmp_path, strict=False)
    assert len(data.conversations) == 1 and "question_ID" in data.skipped[0][1]


def _role_record(**change):
    record = {"question": "q", "ground_truth": "a", "question_ID": "T1",
              "history": [{"role": "x", "content": "c"}, {"role": "y", "content": "d"}],
              "mistake_step": "1", "mistake_agent": "y"}
    record.update(change)
    return record


def _folder(tmp_path, files):
    folder = tmp_path / "Hand-Crafted"
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def test_huge_mistake_step_is_skippable(tmp_path):
    from skafa.datasets import load_who_and_when

    text = json.dumps(_role_record()).replace('"mistake_step": "1"', '"mistake_step": ' + "9" * 5000)
    folder = _folder(tmp_path, {"1.json": json.dumps(_role_record()), "2.json": text})
    with pytest.raises(ConversationError, match="2.json"):
        load_who_and_when(folder)
    with pytest.warns(UserWarning, match="skipped 1"):
        data = load_who_and_when(folder, strict=False)
    assert len(data.conversations) == 1
    with pytest.raises(ConversationError, match="outside any history"):
        Conversation.from_who_and_when(_role_record(mistake_step="9" * 5000))


@pytest.mark.parametrize("key", ["question", "ground_truth"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused(tmp_path, key, value):
    from skafa.datasets import load_who_and_when

    text = json.dumps(_role_record(**{key: "PLACEHOLDER"})).replace('"PLACEHOLDER"', value)
    folder = _folder(tmp_path, {"1.json": text})
    with pytest.raises(ConversationError, match="1.json"):
        load_who_and_when(folder)
    with pytest.raises(ConversationError, match=f"'{key}' is .*not read as"):
        Conversation.from_who_and_when(_role_record(**{key: float(value)}))


def test_same_record_id_twice_is_refused(tmp_path):
    from skafa.datasets import load_who_and_when

    folder = _folder(tmp_path, {"1.json": json.dumps(_role_record()),
                                "1.JSON": json.dumps(_role_record())})
    if len(list(folder.iterdir())) < 2:
        pytest.skip("case-insensitive file system")
    with pytest.raises(ConversationError, match="record id 'Hand-Crafted/1'"):
        load_who_and_when(folder)


def test_unlabelled_runs_load_and_metrics_skip_them(tmp_path):
    from skafa.datasets import load_who_and_when
    from skafa.metrics import drop_unlabelled, step_accuracy

    absent = _role_record()
    del absent["mistake_step"], absent["mistake_agent"]
    folder = _folder(tmp_path, {"1.json": json.dumps(_role_record()),
                                "2.json": json.dumps(absent),
                                "3.json": json.dumps(_role_record(mistake_step=None,
                                                             mistake_agent=None))})
    with pytest.raises(ConversationError, match=r"2\.json.*labelled='auto'"):
        load_who_and_when(folder, labelled=True)
    data = load_who_and_when(folder)  # labelled="auto" is the default
    assert [c.mistake_step for c in data.conversations] == [1, None, None]
    assert data.mistake_agents.tolist() == ["y", None, None]
    assert data.mistake_steps.tolist() == [1, -1, -1]
    none = load_who_and_when(folder, labelled=False)
    assert all(c.mistake_step is None for c in none.conversations)
    with pytest.warns(UserWarning, match="skipped 2 unlabelled conversation"):
        y, p = drop_unlabelled(data.mistake_steps, [1, 0, 0])
    assert step_accuracy(y, p) == 1.0
    with pytest.raises(ValueError, match="all 2 conversations are unlabelled"):
        drop_unlabelled([None, -1], [0, 0])
    conv = Conversation.from_who_and_when(absent, labelled="auto")
    assert conv.mistake_step is None and conv.mistake_agent is None


def test_unlabelled_records_through_return_x_y_and_fit(tmp_path):
    from skafa.baselines import DummyStepClassifier

    folder = _folder(tmp_path, {"1.json": json.dumps(_role_record()),
                                "2.json": json.dumps(_role_record(mistake_step=None,
                                                                  mistake_agent=None))})
    X, y, groups = load_who_and_when(folder, return_X_y=True)
    assert [c.mistake_step for c in X] == [1, None] and y.tolist() == [1, -1]
    assert y.dtype == np.int64 and groups.tolist() == ["T1", "T1"]
    # fit refuses the -1 of an unlabelled record, naming the record
    with pytest.raises(ValueError, match=r"y\[1\]=-1.*'Hand-Crafted/2'"):
        DummyStepClassifier().fit(X, y)
    # ... and the -1 is what the metrics skip
    from skafa.metrics import step_accuracy
    with pytest.warns(UserWarning, match="skipped 1 unlabelled"):
        assert step_accuracy(y, [1, 0]) == 1.0


def test_half_labelled_records_in_the_loader(tmp_path):
    folder = _folder(tmp_path, {"1.json": json.dumps(_role_record(mistake_agent=None)),
                                "2.json": json.dumps(_role_record(mistake_step=None))})
    data = load_who_and_when(folder)
    assert data.mistake_steps.tolist() == [1, -1]
    assert data.mistake_agents.tolist() == [None, "y"]
    with pytest.raises(ConversationError, match=r"1\.json.*'mistake_agent'"):
        load_who_and_when(folder, labelled=True)


def test_fetch_passes_labelled_through(tmp_path):
    url = _archive(tmp_path).as_uri()
    data = fetch_who_and_when(tmp_path / "home", url=url, labelled=False)
    assert all(c.mistake_step is None for c in data.conversations)
    assert set(data.mistake_steps.tolist()) == {-1}


# ------------------------------------------------ NaN, Infinity and huge numbers
def _text_with(record, field_value):
    """The JSON text of ``record`` with the string "@@" replaced by ``field_value``."""
    return json.dumps(record).replace('"@@"', field_value)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_nan_step_names_file_and_field(tmp_path, value):
    folder = _folder(tmp_path, {"1.json": json.dumps(_role_record()),
                                "2.json": _text_with(_role_record(mistake_step="@@"), value)})
    with pytest.raises(ConversationError) as info:
        load_who_and_when(folder)
    message = str(info.value)
    assert "2.json" in message and "'Hand-Crafted/2'" in message
    assert "field 'mistake_step'" in message and value in message
    with pytest.warns(UserWarning, match="skipped 1"):
        data = load_who_and_when(folder, strict=False)
    assert data.record_ids.tolist() == ["Hand-Crafted/1"]
    assert "field 'mistake_step'" in data.skipped[0][1]


def test_infinity_in_a_turn_text_names_the_turn_field(tmp_path):
    history = [{"role": "x", "content": "c"}, {"role": "y", "content": "@@"}]
    folder = _folder(tmp_path, {"7.json": _text_with(_role_record(history=history),
                                                     "Infinity")})
    with pytest.raises(ConversationError,
                       match=r"7\.json.*'Hand-Crafted/7'.*field 'history\[1\]\.content' is "
                             r"Infinity"):
        load_who_and_when(folder)


def test_nan_in_a_list_file_names_the_record_and_skips_only_it(tmp_path):
    records = [_role_record(), _role_record(), _role_record(extra={"deep": [1, "@@"]})]
    records[1]["history"][0]["content"] = "@@"
    text = json.dumps(records).replace('"@@"', "NaN", 1).replace('"@@"', "-Infinity")
    path = tmp_path / "runs.json"
    path.write_text(text)
    with pytest.raises(ConversationError,
                       match=r"runs\.json\[1\].*'runs/1'.*'history\[0\]\.content' is NaN"):
        load_who_and_when(path)
    with pytest.warns(UserWarning, match="skipped 2"):
        data = load_who_and_when(path, strict=False)
    assert data.record_ids.tolist() == ["runs/0"]
    assert "'extra.deep[1]' is -Infinity" in data.skipped[1][1]


def test_a_constant_as_a_whole_record_or_key_is_named(tmp_path):
    path = tmp_path / "runs.json"
    path.write_text("[NaN]")
    with pytest.raises(ConversationError, match=r"runs\.json\[0\].*the record is NaN"):
        load_who_and_when(path)


def test_huge_integer_names_the_field(tmp_path):
    digits = "7" * 5000
    folder = _folder(tmp_path, {"3.json": _text_with(_role_record(question_ID="@@"), digits)})
    with pytest.raises(ConversationError,
                       match=r"3\.json.*field 'question_ID' is an integer of 5000 digits"):
        load_who_and_when(folder)
