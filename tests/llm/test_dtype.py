"""dtype="auto", content-keyed model identity and short model names (issues 29 and 33)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from skafa.llm import (
    CPU_FLAGS,
    TurnActivationTransformer,
    _models,
    clear_model_cache,
    cpu_description,
    known_model_path,
    known_models,
    load_model,
    model_identity,
    models_dir,
    register_model,
    resolve_dtype,
    unregister_model,
)
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Fake a CPU with (True) or without (False) native bfloat16 units."""
    def fake(value):
        monkeypatch.setattr(_models, "cpu_has_bf16", lambda: value)
    return fake


@pytest.fixture
def tiny_folder(tmp_path):
    folder = tmp_path / "tiny-llama"
    make_tiny_llama().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


# ------------------------------------------------------------------ resolve_dtype
def test_skafa_cpu_bf16_overrides_the_cpu_flags(monkeypatch):
    monkeypatch.setenv("SKAFA_CPU_BF16", "1")
    assert _models.cpu_has_bf16() is True and resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setenv("SKAFA_CPU_BF16", "0")
    assert _models.cpu_has_bf16() is False and resolve_dtype("auto", "cpu") == "float32"
    monkeypatch.setenv("SKAFA_CPU_BF16", "maybe")  # not 0/1: the CPU's flags decide
    assert _models.cpu_has_bf16() is _models._bf16_flags("/proc/cpuinfo")


def test_cpu_flags_are_read_not_guessed(tmp_path):
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 amx_bf16 amx_tile\n\n")
    avx512 = tmp_path / "avx512"
    avx512.write_text("flags\t\t: fpu avx512f avx512_bf16\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("flags\t\t: fpu sse avx2 avx512f\nbugs\t\t: amx_bf16\n")  # not a flag
    assert _models._bf16_flags(amx) and _models._bf16_flags(avx512)
    assert not _models._bf16_flags(avx2)
    assert not _models._bf16_flags(tmp_path / "missing")
    assert isinstance(_models.cpu_has_bf16(), bool)
    assert _models.cpu_has_bf16() is _models.cpu_has_bf16()  # memoised


def test_cpu_description_names_the_cpu_and_the_flags_that_matter(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\n"
                    "flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
                    "bugs\t\t: amx_bf16\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9B14\n")
    assert cpu_description(info) == "AMD EPYC 9B14 (avx2, avx512f, avx512_bf16)"
    amx = tmp_path / "amx"
    amx.write_text("model name\t: Intel Xeon\nflags\t\t: avx2 amx_tile amx_bf16\n")
    assert cpu_description(amx) == "Intel Xeon (avx2, amx_tile, amx_bf16)"
    bare = tmp_path / "bare"
    bare.write_text("model name\t: Old CPU\nflags\t\t: fpu sse\n")
    assert cpu_description(bare) == "Old CPU (no AVX2, AVX-512 or AMX)"
    missing = cpu_description(tmp_path / "missing")  # no file: a name, no flag
    assert missing.endswith("(no AVX2, AVX-512 or AMX)") and len(missing) > 25
    assert set(CPU_FLAGS) >= {"avx512_bf16", "amx_bf16"}


def test_auto_resolves_by_device_and_cpu(bf16_cpu):
    import torch

    bf16_cpu(False)
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("auto", "mps") == "float32"
    bf16_cpu(True)
    assert resolve_dtype("auto", "cpu") == resolve_dtype() == "bfloat16"
    # an explicit dtype always wins
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype(torch.float16, "cuda") == "float16"
    bf16_cpu(False)
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("AUTO", "cpu")


def test_auto_keeps_a_registered_models_dtype(bf16_cpu):
    import torch

    bf16_cpu(True)
    register_model("dtype-f32", make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    register_model("dtype-bf16", make_tiny_llama().to(torch.bfloat16), make_tiny_tokenizer(),
                   overwrite=True)
    try:
        assert resolve_dtype("auto", "cpu", model="dtype-f32") == "float32"
        assert resolve_dtype("auto", "cpu", model="dtype-bf16") == "bfloat16"
        assert load_model("dtype-f32")[0] is load_model("dtype-f32", dtype="float32")[0]
        with pytest.raises(ValueError, match="holds float32 weights"):
            load_model("dtype-f32", dtype="bfloat16")
    finally:
        unregister_model("dtype-f32")
        unregister_model("dtype-bf16")


def test_load_model_caches_under_the_resolved_dtype(tiny_folder, bf16_cpu):
    import torch

    clear_model_cache()
    bf16_cpu(False)
    model = load_model(str(tiny_folder))[0]
    assert next(model.parameters()).dtype == torch.float32
    assert load_model(str(tiny_folder), dtype="float32")[0] is model
    bf16_cpu(True)
    bf16 = load_model(str(tiny_folder))[0]
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert load_model(str(tiny_folder), dtype="bfloat16")[0] is bf16
    clear_model_cache()


# ------------------------------------------------------------------ estimators
def _extract(folder, cache_dir, dtype):
    convs = make_conversations(3, seed=4)
    ext = TurnActivationTransformer(str(folder), sites=["resid_pre.1", "resid_final"],
                                    dtype=dtype, cache_dir=str(cache_dir), memory_cache=False)
    X = ext.fit(convs).transform(convs)
    return ext, X


def test_extractor_default_is_auto_and_cache_key_uses_resolved(tiny_folder, tmp_path,
                                                                bf16_cpu):
    assert TurnActivationTransformer().dtype == "auto"
    cache = tmp_path / "cache"
    bf16_cpu(False)
    auto, X_auto = _extract(tiny_folder, cache, "auto")
    assert auto.dtype == "auto" and auto.dtype_ == "float32"  # parameter kept verbatim
    assert auto.run_stats["n_forward_passes"] > 0
    # explicit float32 shares auto's entries: no forward pass
    f32, X_f32 = _extract(tiny_folder, cache, "float32")
    assert f32.run_stats["n_forward_passes"] == 0
    np.testing.assert_array_equal(X_f32.values, X_auto.values)
    assert f32._key(make_conversations(1)[0]) == auto._key(make_conversations(1)[0])
    # auto on a CPU with bf16 units: bfloat16, another key, its own forward passes
    bf16_cpu(True)
    bf16, X_bf16 = _extract(tiny_folder, cache, "auto")
    assert bf16.dtype_ == "bfloat16"
    assert bf16._key(make_conversations(1)[0]) != auto._key(make_conversations(1)[0])
    assert bf16.run_stats["n_forward_passes"] > 0
    assert not np.array_equal(X_bf16.values, X_auto.values)
    # ... and an explicit float32 still wins there
    again, _ = _extract(tiny_folder, cache, "float32")
    assert again.dtype_ == "float32" and again.run_stats["n_forward_passes"] == 0
    # the plan line names the resolved dtype
    assert "model in bfloat16" in bf16.estimate_cost(make_conversations(3, seed=9),
                                                     calibrate=False)["summary"]
    clear_model_cache()


def test_saved_file_records_the_resolved_dtype(tiny_folder, tmp_path, bf16_cpu):
    from skafa.persistence import load, save

    bf16_cpu(True)
    ext, X = _extract(tiny_folder, tmp_path / "cache", "auto")
    path = save(ext, tmp_path / "saved")
    doc = json.loads((Path(path) / "skafa.json").read_text())
    assert [m["dtype"] for m in doc["models"]] == ["bfloat16"]
    # loaded where auto means float32, it keeps computing in the dtype it was fitted in
    bf16_cpu(False)
    loaded = load(path)
    assert loaded.dtype == "auto" and loaded.dtype_ == "bfloat16"
    convs = make_conversations(3, seed=4)
    np.testing.assert_array_equal(loaded.transform(convs).values, X.values)
    clear_model_cache()


def test_judge_default_is_auto(bf16_cpu):
    from skafa.baselines import PromptedJudge

    assert PromptedJudge().dtype == "auto"
    bf16_cpu(True)
    register_model("dtype-judge", make_tiny_llama(), make_tiny_tokenizer(), overwrite=True)
    try:
        judge = PromptedJudge("dtype-judge").fit(make_conversations(2))
        assert judge.dtype == "auto" and judge.dtype_ == "float32"  # registered: as it is
    finally:
        unregister_model("dtype-judge")


def test_cli_dtype_option(bf16_cpu):
    from skafa.cli import _plan_line, build_parser

    args = build_parser().parse_args(["fit", "data", "--out", "o", "--model", "m.gguf"])
    assert args.dtype == "auto"
    bf16_cpu(False)
    assert _plan_line(args, 7).endswith("on cpu in float32 (--dtype auto)")
    args = build_parser().parse_args(["fit", "data", "--out", "o", "--dtype", "bfloat16"])
    assert _plan_line(args, 7).endswith("in bfloat16")


# ------------------------------------------------------------------ content identity
def test_identity_keys_on_the_whole_content(tmp_path, monkeypatch):
    calls = []
    real = _models._sha256_file
    monkeypatch.setattr(_models, "_sha256_file", lambda p: calls.append(p) or real(p))
    f = tmp_path / "w.gguf"
    f.write_bytes(b"GGUF" + bytes(3 << 20))
    first = model_identity(str(f))
    assert model_identity(str(f)) == first and len(calls) == 1  # memo hit: hashed once
    # retrained in place: same size, same head and tail, another middle
    data = bytearray(f.read_bytes())
    data[len(data) // 2] = 1
    st = f.stat()
    f.write_bytes(bytes(data))
    # a later write (a coarse clock may give two quick writes the same mtime)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = model_identity(str(f))
    assert second["file_size"] == first["file_size"] and second["sha256"] != first["sha256"]
    assert len(calls) == 2


def test_folder_retrained_in_place_gets_another_cache_key(tiny_folder, tmp_path, bf16_cpu):
    bf16_cpu(False)
    cache = tmp_path / "cache"
    old, X_old = _extract(tiny_folder, cache, "auto")
    weights = tiny_folder / "model.safetensors"
    size, st = weights.stat().st_size, weights.stat()
    make_tiny_llama(seed=1).save_pretrained(tiny_folder)  # same architecture, new weights
    assert weights.stat().st_size == size
    os.utime(weights, ns=(st.st_atime_ns, max(weights.stat().st_mtime_ns,
                                              st.st_mtime_ns + 10**9)))
    clear_model_cache()
    new, X_new = _extract(tiny_folder, cache, "auto")
    assert new.model_identity_ != old.model_identity_
    conv = make_conversations(1)[0]
    assert new._key(conv) != old._key(conv)
    assert new.run_stats["n_forward_passes"] > 0  # not the old model's activations
    assert not np.array_equal(X_new.values, X_old.values)
    clear_model_cache()


# ------------------------------------------------------------------ short names
def test_short_names_and_budgets(tmp_path, monkeypatch):
    models = known_models()
    assert {"smollm2", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "gemma-3-270m"} <= set(models)
    assert models["qwen2.5-coder-1.5b"].prompt_budget == 32768
    assert models["gemma-3-270m"].prompt_budget == 32768
    assert models["smollm2"].prompt_budget == 8192
    monkeypatch.delenv("SKAFA_MODELS_DIR", raising=False)
    assert models_dir() == Path("~/.skafa/models").expanduser()
    monkeypatch.setenv("SKAFA_MODELS_DIR", str(tmp_path))
    assert models_dir() == tmp_path
    with pytest.raises(FileNotFoundError) as err:
        load_model("qwen2.5-coder-1.5b")
    msg = str(err.value)
    assert "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" in msg and str(tmp_path) in msg
    assert "bash ../shared/models/fetch_qwen_coder_1_5b.sh DEST_DIR" in msg
    assert "export SKAFA_MODELS_DIR=DEST_DIR" in msg
    (tmp_path / "gemma-3-270m-q4_k_m.gguf").write_bytes(b"GGUF")
    assert known_model_path("Gemma-3-270M") == str(tmp_path / "gemma-3-270m-q4_k_m.gguf")
    assert model_identity("gemma-3-270m")["name"] == "gemma-3-270m-q4_k_m.gguf"
    with pytest.raises(KeyError, match="not a short model name"):
        known_model_path("llama-70b")


@pytest.mark.integration
def test_qwen_1_5b_by_short_name(monkeypatch):
    """Run with SKAFA_MODELS_DIR pointing at the fetched file (about a minute)."""
    folder = os.environ.get("SKAFA_MODELS_DIR")
    entry = known_models()["qwen2.5-coder-1.5b"]
    if not folder or not (Path(folder) / entry.file).is_file():
        pytest.skip(f"{entry.file} not in $SKAFA_MODELS_DIR ({folder}); {entry.fetch}")
    pytest.importorskip("gguf", reason="loading GGUF needs: pip install \"skafa[gguf]\"")
    from skafa.conversation import Conversation, Turn

    conv = Conversation([Turn("Planner", "Compute 2 + 3."), Turn("Coder", "print(2 + 3)"),
                         Turn("Checker", "The output is 5.")], task="Add two numbers.")
    ext = TurnActivationTransformer("qwen2.5-coder-1.5b", sites=["resid_pre.14", "resid_final"])
    X = ext.fit([conv]).transform([conv])
    assert ext.n_layers_ == 28 and ext.hidden_size_ == 1536
    assert ext.context_length_ == entry.prompt_budget == 32768
    assert ext.dtype_ == resolve_dtype("auto", "cpu")
    assert X.values.shape == (3, 2, 1536) and np.isfinite(X.values).all()
    assert ext.model_identity_["name"] == entry.file and len(ext.model_identity_["sha256"]) == 64
