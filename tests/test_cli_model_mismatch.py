"""A saved probe meets another model under the same (relative) path ("Hostile and odd
input, round four", item 1).

A probe saved with ``models/tiny`` (a relative folder) is used from another working
directory whose ``models/tiny`` holds other weights of the same architecture. skafa
refuses to score with it, naming both places and both weights digests, unless the
caller names the model explicitly *and* allows the mismatch (then it warns with
:class:`~skafa.exceptions.ModelMismatchWarning`).
"""

import json
import warnings

import pytest
from sklearn.model_selection import GroupKFold

from skafa import FailureAttributor
from skafa.cli import EXIT_MODEL, EXIT_OK, EXIT_USAGE, main
from skafa.exceptions import ModelMismatchWarning
from skafa.llm import TurnActivationTransformer, model_identity
from skafa.model_selection import SiteSelector
from skafa.persistence import load
from skafa.probes import GroupedArgmaxLogisticClassifier
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer


def _record(conv):
    return {"question": conv.task, "ground_truth": conv.expected_answer,
            "question_ID": conv.task_id,
            "history": [{"name": t.speaker, "role": "assistant", "content": t.content}
                        for t in conv.turns],
            "mistake_step": str(conv.mistake_step), "mistake_agent": conv.mistake_agent}


@pytest.fixture(scope="module")
def two_places(tmp_path_factory):
    """``a/models/tiny`` and ``b/models/tiny``: same architecture, other weights; a
    FailureAttributor fitted in ``a`` with the relative path ``models/tiny``, saved."""
    import os

    root = tmp_path_factory.mktemp("mismatch")
    places = {}
    for name, seed in (("a", 0), ("b", 1)):
        folder = root / name / "models" / "tiny"
        make_tiny_llama(seed=seed).save_pretrained(folder)
        make_tiny_tokenizer().save_pretrained(folder)
        places[name] = (str(folder.resolve()),
                        model_identity(str(folder))["weights"]["model.safetensors"])
    assert places["a"][1] != places["b"][1]
    data = root / "runs.json"
    data.write_text(json.dumps([_record(c) for c in make_conversations(3, seed=4)]))
    before = os.getcwd()
    os.chdir(root / "a")
    try:
        fa = FailureAttributor(
            TurnActivationTransformer("models/tiny", sites=["resid_final"],
                                      memory_cache=False),
            SiteSelector(GroupedArgmaxLogisticClassifier(random_state=0), cv=GroupKFold(2)),
        ).fit(make_conversations(8, seed=2))
        fa.save(root / "probe")
    finally:
        os.chdir(before)
    return root, places, data


def _attribute(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_refuses_other_weights_under_the_saved_path(two_places, monkeypatch, capsys):
    root, places, data = two_places
    probe = str(root / "probe")
    monkeypatch.chdir(root / "b")
    code, _, err = _attribute(["attribute", probe, str(data), "-q"], capsys)
    assert code == EXIT_MODEL, err
    for place, digest in places.values():  # both places and both full digests
        assert place in err and digest in err, err
    assert "Traceback" not in err and "unexpected" not in err
    assert "--model" in err and "--allow-model-mismatch" in err
    # naming the model is not enough: the weights still differ
    code, _, err = _attribute(["attribute", probe, str(data), "--model", "models/tiny", "-q"],
                              capsys)
    assert code == EXIT_MODEL and places["b"][1] in err
    # the same for report and benchmark --attributor
    code, _, err = _attribute(["report", probe, str(data), "--out",
                               str(root / "r.html"), "-q"], capsys)
    assert code == EXIT_MODEL and places["a"][1] in err and places["b"][1] in err
    code, _, err = _attribute(["benchmark", str(data), "--attributor", probe,
                               "--n-resamples", "20", "-q"], capsys)
    assert code == EXIT_MODEL and places["a"][1] in err and places["b"][1] in err


def test_cli_goes_on_with_the_named_model_when_allowed(two_places, monkeypatch, capsys):
    root, places, data = two_places
    probe = str(root / "probe")
    monkeypatch.chdir(root / "b")
    out = root / "b" / "blame.json"
    with pytest.warns(ModelMismatchWarning, match="weights differ"):
        code, _, err = _attribute(["attribute", probe, str(data), "--model", "models/tiny",
                                   "--allow-model-mismatch", "--output", str(out), "-q"],
                                  capsys)
    assert code == EXIT_OK, err
    assert len(json.loads(out.read_text())) == 3
    with pytest.warns(ModelMismatchWarning):
        code, _, err = _attribute(["benchmark", str(data), "--attributor", probe, "--model",
                                   "models/tiny", "--allow-model-mismatch", "--n-resamples",
                                   "20", "-q"], capsys)
    assert code == EXIT_OK, err


def test_cli_allow_model_mismatch_needs_model(two_places, monkeypatch, capsys):
    root, _, data = two_places
    code, _, err = _attribute(["attribute", str(root / "probe"), str(data),
                               "--allow-model-mismatch"], capsys)
    assert code == EXIT_USAGE
    assert "--allow-model-mismatch" in err and "--model" in err


def test_cli_same_place_same_weights_is_silent(two_places, monkeypatch, capsys):
    root, _, data = two_places
    monkeypatch.chdir(root / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        code, _, err = _attribute(["attribute", str(root / "probe"), str(data), "-q"], capsys)
    assert code == EXIT_OK, err


def test_load_refuses_unless_named_and_allowed(two_places, monkeypatch):
    root, places, _ = two_places
    probe = root / "probe"
    monkeypatch.chdir(root / "b")
    with pytest.raises(ValueError) as info:
        load(probe)
    message = str(info.value)
    for place, digest in places.values():
        assert place in message and digest in message
    assert "allow_model_mismatch=True" in message and "skafa.json" in message
    with pytest.raises(ValueError, match="weights"):
        load(probe, model="models/tiny")                # named, not allowed
    with pytest.raises(ValueError, match="allow_model_mismatch=True needs model="):
        load(probe, allow_model_mismatch=True)          # allowed, not named
    with pytest.raises(ValueError, match="weights"):
        FailureAttributor.load(probe, model="models/tiny")
    with pytest.warns(ModelMismatchWarning, match="weights differ"):
        fa = FailureAttributor.load(probe, model="models/tiny", allow_model_mismatch=True)
    assert fa.pipeline_.named_steps["acts"].model_identity_ == model_identity("models/tiny")
    fa.predict(make_conversations(2, seed=5))
