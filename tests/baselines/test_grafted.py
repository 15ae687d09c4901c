"""Tests of skafa.baselines.GraftedJudge and head_direct_effects (tiny random models)."""

import json
import os

import numpy as np
import pytest
import torch
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, GroupKFold

from skafa.baselines import GraftedJudge, PromptedJudge, head_direct_effects
from skafa.baselines._judge import answer_token_plan, number_continuation_mask
from skafa.llm import (
    PromptTemplate,
    decoder_layout,
    head_attention_rows,
    load_model,
    register_model,
)
from skafa.testing import (
    make_conversations,
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_tokenizer,
)

LLAMA = "skafa-test-graft-llama"
QWEN = "skafa-test-graft-qwen2"
GEMMA3 = "skafa-test-graft-gemma3"


def _sharpen(model, scale=30.0):
    """Sharp attention (a fresh model attends almost uniformly, hiding wrong masks)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(scale)
            layer.self_attn.k_proj.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def tiny():
    tok = make_tiny_tokenizer()
    register_model(LLAMA, _sharpen(make_tiny_llama(max_position_embeddings=4096, seed=3)),
                   tok, overwrite=True)  # eager attention
    qwen = _sharpen(make_tiny_qwen2(max_position_embeddings=4096, seed=4))
    qwen.set_attn_implementation("sdpa")
    register_model(QWEN, qwen, tok, overwrite=True)
    gemma3 = _sharpen(make_tiny_gemma3(max_position_embeddings=4096, seed=6, n_layers=3,
                                       sliding_window=8))
    gemma3.set_attn_implementation("sdpa")  # sliding-window layers, sandwich norms
    register_model(GEMMA3, gemma3, tok, overwrite=True)
    return tok


@pytest.fixture(scope="module")
def convs():
    return make_conversations(8, min_turns=2, max_turns=6, seed=7)


def _steps(convs):
    return np.array([c.mistake_step for c in convs])


def _fixed(name, convs, locators, writers, *, mix=1.0, batch_size=1):
    """A judge fitted with one pair, then given these heads (a chosen graft)."""
    judge = GraftedJudge(name, locator_grid=(len(locators),), writer_grid=(len(writers),),
                         mix=mix, batch_size=batch_size).fit(convs)
    judge.locator_heads_ = list(locators)
    judge.writer_heads_ = list(writers)
    return judge


def _split_case(convs):
    """Groups, labels, two splits and a judge with two (locators, writers) pairs."""
    groups = np.array([c.task_id for c in convs])
    splits = [(np.arange(5), np.arange(5, 8)), (np.arange(3, 8), np.arange(3))]
    judge = GraftedJudge(LLAMA, locator_grid=(1, 2), writer_grid=(1,), cv=GroupKFold(2))
    return groups, _steps(convs), splits, judge


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- inactive graft
@pytest.mark.parametrize("name", [LLAMA, GEMMA3])
def test_no_graft_equals_the_prompted_judge_exactly(tiny, convs, name):
    convs = convs[:5]
    plain = PromptedJudge(name, batch_size=3).fit(convs)
    ref = plain.turn_decision_function(convs)
    judges = [GraftedJudge(name, locator_grid=(2,), writer_grid=(2,), mix=0.0, batch_size=3),
              GraftedJudge(name, locator_grid=(0,), writer_grid=(2,), batch_size=3),
              GraftedJudge(name, locator_grid=(1,), writer_grid=(0,), batch_size=3)]
    for judge in judges:
        judge.fit(convs)
        assert not judge._grafting()
        assert _same(judge.turn_decision_function(convs), ref)
    np.testing.assert_array_equal(judges[0].predict(convs), plain.predict(convs))
    assert _same(judges[0].turn_predict_proba(convs), plain.turn_predict_proba(convs))


@pytest.mark.parametrize("name", [LLAMA, QWEN, GEMMA3])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_writer_grafted_onto_itself_changes_nothing(tiny, convs, name, batch_size):
    # the writer's new attention is its own: the output is recomputed as weights @ V
    # through the override, so positions, padding and batching are all exercised
    plain = PromptedJudge(name, batch_size=batch_size).fit(convs).turn_decision_function(convs)
    for mix in (1.0, 0.4):
        judge = _fixed(name, convs, [(1, 2)], [(1, 2)], mix=mix, batch_size=batch_size)
        assert judge._grafting()
        for got, ref in zip(judge.turn_decision_function(convs), plain):
            np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_the_graft_changes_the_output_only_while_active(tiny, convs):
    plain = PromptedJudge(LLAMA).fit(convs)
    before = plain.turn_decision_function(convs)
    grafted = _fixed(LLAMA, convs, [(0, 2), (1, 1)], [(1, 0), (1, 3)])
    after = grafted.turn_decision_function(convs)
    assert max(np.abs(a - b).max() for a, b in zip(after, before)) > 1e-2
    # the graft lives inside the call: the model answers as before afterwards
    assert _same(plain.turn_decision_function(convs), before)
    # and it is deterministic
    assert _same(grafted.turn_decision_function(convs), after)


# ----------------------------------------------------------------------------- reference
def _full_sequence_scores(name, tok, judge, conv, locators, writers, mix):
    """Graft by hand: one full forward per candidate (no cache, no packing, no padding)."""
    model, _ = load_model(name)
    enc = judge.prompt_.encode(conv, tok)
    shared, conts = answer_token_plan(tok, judge.answer_prefix, len(conv))
    prefix = list(enc.input_ids) + list(shared)
    answer = len(prefix) - 1
    with torch.no_grad(), head_attention_rows(model, [answer]) as rows:
        model(input_ids=torch.tensor([prefix]), use_cache=False)
    own = {layer: rows.weights[layer][0, :, 0].double().numpy() for layer in rows.weights}
    located = np.mean([own[lay][h] for lay, h in locators], axis=0)
    ends = torch.as_tensor(~number_continuation_mask(
        tok, model.get_output_embeddings().weight.shape[0]))
    out = []
    for cont in conts:
        ids = prefix + list(cont)
        override = {}
        for lay, h in writers:
            w = np.zeros((1, len(ids)))
            w[0, :len(prefix)] = mix * located + (1 - mix) * own[lay][h]
            override[(lay, h)] = torch.tensor(w, dtype=torch.float32)
        with torch.no_grad(), head_attention_rows(model, [answer], override=override):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        total = sum(float(logp[p - 1, ids[p]]) for p in range(len(prefix), len(ids)))
        last = logits[-1]
        total += float(torch.logsumexp(last[ends], 0) - torch.logsumexp(last, 0))
        out.append(total)
    return np.array(out)


@pytest.mark.parametrize("name", [LLAMA, QWEN, GEMMA3])
def test_grafted_scores_match_a_full_sequence_reference(tiny, convs, name):
    locators, writers, mix = [(0, 1), (1, 3)], [(1, 0), (0, 2)], 0.7
    judge = _fixed(name, convs, locators, writers, mix=mix, batch_size=3)
    scores = judge.turn_decision_function(convs)
    for conv, got in zip(convs, scores):
        ref = _full_sequence_scores(name, tiny, judge, conv, locators, writers, mix)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------- ranking
@pytest.mark.parametrize("make", [make_tiny_llama, make_tiny_qwen2])
def test_a_grafted_step_resumes_at_the_lowest_grafted_layer_bit_for_bit(tiny, make):
    from skafa.baselines import _grafted

    model = _sharpen(make(n_layers=4, seed=11, max_position_embeddings=512))
    if make is make_tiny_qwen2:
        model.set_attn_implementation("sdpa")
    vocab = model.get_output_embeddings().weight.shape[0]
    mask = number_continuation_mask(tiny, vocab)
    prefix = np.random.default_rng(0).integers(3, vocab, size=40)
    digits = np.flatnonzero(mask)[:4].tolist()
    conts = [[digits[0]], [digits[1], digits[2]], [digits[3], digits[0], digits[1]]]
    layers = decoder_layout(model).layers
    wrapper = layers[1].forward  # an instance-level forward (as accelerate sets) comes back
    layers[1].forward = wrapper
    ran = []
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
             for i, layer in enumerate(layers)]
    session = _grafted._AnswerSession(model, prefix, conts, mask, 0)
    clean, rows, _ = session.step()
    try:
        for heads in ([(1, 0)], [(2, 3), (3, 1)], [(3, 2)], [(0, 1), (2, 0)]):
            override = {h: rows[(h[0] + 1) % 4, (h[1] + 1) % 4][None] for h in heads}
            full, full_rows, _ = session.step(override=override)  # rows wanted: every layer
            del ran[:]
            fast, fast_rows, _ = session.step(override=override, rows=False)
            first = min(layer for layer, _ in heads)
            assert sorted(set(ran)) == list(range(first, 4))
            assert (fast_rows is None) == (first > 0) and full_rows is not None
            np.testing.assert_array_equal(fast, full)
            assert np.abs(full - clean).max() > 1e-4  # the graft does change the scores
            assert all("forward" not in layer.__dict__ for i, layer in enumerate(layers)
                       if i != 1) and layers[1].__dict__["forward"] is wrapper
            assert {int(session.cache.get_seq_length(i)) for i in range(4)} == {39}
    finally:
        for hook in hooks:
            hook.remove()
    np.testing.assert_array_equal(session.step()[0], clean)  # the cache is whole again


def test_locator_scores_are_the_mean_mass_on_the_decisive_turn(tiny, convs):
    judge = GraftedJudge(LLAMA, locator_grid=(2,), writer_grid=(3,)).fit(convs)
    model, tok = load_model(LLAMA)  # eager: output_attentions is the reference
    y = _steps(convs)
    mass = []
    for conv, step in zip(convs, y):
        enc = judge.prompt_.encode(conv, tok)
        shared, _ = answer_token_plan(tok, judge.answer_prefix, len(conv))
        ids = list(enc.input_ids) + list(shared)
        with torch.no_grad():
            att = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        a, b = int(enc.turn_start_positions[step]), int(enc.turn_positions[step]) + 1
        mass.append([[float(layer[0, h, -1, a:b].sum()) for h in range(layer.shape[1])]
                     for layer in att])
    np.testing.assert_allclose(judge.head_locator_scores_, np.mean(mass, axis=0), atol=1e-5)
    assert judge.head_locator_scores_.shape == (judge.n_layers_, judge.n_heads_) == (2, 4)
    order = np.argsort(-judge.head_locator_scores_.ravel(), kind="stable")[:2]
    assert judge.locator_heads_ == [(int(i // 4), int(i % 4)) for i in order]
    order = np.argsort(-judge.head_writer_scores_.ravel(), kind="stable")[:3]
    assert judge.writer_heads_ == [(int(i // 4), int(i % 4)) for i in order]
    assert judge.n_locators_ == 2 and judge.n_writers_ == 3 and judge.cv_results_ is None


@pytest.mark.parametrize("name", [LLAMA, GEMMA3])
def test_direct_effects_of_a_layer_sum_to_its_attention_output(tiny, convs, name):
    # per-head effects split the layer's attention output through o_proj exactly; with
    # the norms' scales fixed, their sum is the attention output's own direct effect
    model, tok = load_model(name)
    layout = decoder_layout(model)
    prefix = list(PromptTemplate().encode(convs[0], tok).input_ids)
    tokens = [5, 17, 40]
    effects = head_direct_effects(model, prefix, tokens)
    assert effects.shape == (layout.n_layers, 4, 3) and effects.dtype == np.float32
    seen = {}
    hooks = [layout.final_norm.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("x", a[0][0, -1].double()))]
    for i, layer in enumerate(layout.layers):
        out_module = (layer.post_attention_layernorm if layout.family == "sandwich-norm"
                      else layer.self_attn.o_proj)
        hooks.append(out_module.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(i, o[0, -1].double())))
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix]), use_cache=False)
    for h in hooks:
        h.remove()
    norm = layout.final_norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    weight = norm.weight.double() + (1.0 if layout.family == "sandwich-norm" else 0.0)
    rms = torch.sqrt(seen["x"].pow(2).mean() + eps)
    unembed = model.get_output_embeddings().weight.double()[tokens]
    for i in range(layout.n_layers):
        expected = unembed @ (weight * seen[i] / rms)
        np.testing.assert_allclose(effects[i].sum(0), expected.numpy(), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- selection
def test_inner_folds_choose_the_best_pair(tiny, convs):
    groups = [c.task_id for c in convs]
    judge = GraftedJudge(LLAMA, locator_grid=(1, 2), writer_grid=(0, 1), cv=2)
    judge.fit(convs, groups=groups)
    res = judge.cv_results_
    assert res["params"] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert res["split_test_scores"].shape == (4, 2)
    best = max(range(4), key=lambda k: (res["mean_test_score"][k], -sum(res["params"][k]),
                                        -res["params"][k][0]))
    assert (judge.n_locators_, judge.n_writers_) == res["params"][best]
    assert len(judge.locator_heads_) == judge.n_locators_
    assert len(judge.writer_heads_) == judge.n_writers_
    # (n, 0) is the plain judge: its inner score is the prompted judge's on those folds
    plain = PromptedJudge(LLAMA).fit(convs)
    hits = plain.predict(convs) == _steps(convs)
    for fold, (_, test) in enumerate(GroupKFold(2).split(convs, groups=groups)):
        assert res["split_test_scores"][0, fold] == pytest.approx(hits[test].mean())
    # a splitter object and explicit groups give the same choice
    again = GraftedJudge(LLAMA, locator_grid=(1, 2), writer_grid=(0, 1), cv=GroupKFold(2))
    again.fit(convs, groups=groups)
    np.testing.assert_array_equal(again.cv_results_["mean_test_score"], res["mean_test_score"])


def test_clone_and_grid_search_with_group_kfold(tiny, convs):
    judge = GraftedJudge(LLAMA, locator_grid=(1,), writer_grid=(1,))
    assert clone(judge).get_params() == judge.get_params()
    search = GridSearchCV(judge, {"mix": [0.0, 1.0], "writer_grid": [(1,), (2,)]},
                          cv=GroupKFold(2)).fit(convs, _steps(convs),
                                                groups=[c.task_id for c in convs])
    assert search.cv_results_["mean_test_score"].shape == (4,)
    assert isinstance(search.best_estimator_, GraftedJudge)
    assert search.best_estimator_.predict(convs).shape == (len(convs),)


def test_save_load_round_trip(tiny, convs, tmp_path):
    from skafa.persistence import load, save

    judge = GraftedJudge(LLAMA, locator_grid=(1, 2), writer_grid=(1,), mix=0.8, cv=2)
    judge.fit(convs)
    save(judge, tmp_path / "judge")
    again = load(tmp_path / "judge")
    assert type(again) is GraftedJudge and again.get_params() == judge.get_params()
    assert again.locator_heads_ == judge.locator_heads_
    assert again.writer_heads_ == judge.writer_heads_
    np.testing.assert_array_equal(again.head_writer_scores_, judge.head_writer_scores_)
    assert _same(again.turn_decision_function(convs), judge.turn_decision_function(convs))
    np.testing.assert_array_equal(again.predict(convs), judge.predict(convs))


def test_predict_agent_score_and_validation(tiny, convs):
    judge = GraftedJudge(LLAMA, locator_grid=(1,), writer_grid=(1,)).fit(convs)
    pred = judge.predict(convs)
    assert list(judge.predict_agent(convs)) == [c.turns[p].speaker
                                                for c, p in zip(convs, pred)]
    assert judge.score(convs) == pytest.approx(np.mean(pred == _steps(convs)))
    with pytest.raises(TypeError, match="sample_weight"):
        judge.score(convs, sample_weight=np.ones(len(convs)))
    with pytest.raises(ValueError, match="locator_grid"):
        GraftedJudge(LLAMA, locator_grid=()).fit(convs)
    with pytest.raises(ValueError, match="writer_grid"):
        GraftedJudge(LLAMA, writer_grid=(1, -1)).fit(convs)
    with pytest.raises(ValueError, match="mix"):
        GraftedJudge(LLAMA, mix=1.5).fit(convs)
    with pytest.raises(ValueError, match="at least 2 groups"):
        GraftedJudge(LLAMA, writer_grid=(1, 2)).fit(convs, groups=[0] * len(convs))
    unlabelled = make_conversations(3, seed=1, labelled=False)
    with pytest.raises(ValueError, match="GraftedJudge"):
        GraftedJudge(LLAMA).fit(unlabelled)


# ----------------------------------------------------------------------------- split predictions
@pytest.mark.parametrize("name", [LLAMA, GEMMA3])
def test_split_predictions_equal_fitting_on_each_split(tiny, convs, name, monkeypatch):
    from skafa.baselines import _grafted, grafted_split_predictions

    groups = np.array([c.task_id for c in convs])
    y = _steps(convs)
    splits = [(np.array([0, 1, 2, 3, 4]), np.array([5, 6, 7])),
              (np.array([2, 3, 4, 5, 6, 7]), np.array([0, 1])),
              (np.array([0, 1, 5, 6, 7]), np.array([2, 3, 4]))]
    # Gemma-3's sliding windows rerun the prompt per graft: a smaller grid keeps it quick
    writer_grid = (0, 1, 2) if name == LLAMA else (0, 1)
    judge = GraftedJudge(name, locator_grid=(1, 2), writer_grid=writer_grid, cv=GroupKFold(2))
    expected, heads = [], []
    for train, test in splits:
        fitted = clone(judge).fit([convs[i] for i in train], y[train], groups=groups[train])
        expected.append(fitted.predict([convs[i] for i in test]))
        heads.append((fitted.locator_heads_, fitted.writer_heads_))
    opened = []
    real = _grafted._AnswerSession.__init__

    def counting(self, lm, prefix, *args, **kwargs):
        opened.append(len(prefix))
        real(self, lm, prefix, *args, **kwargs)

    monkeypatch.setattr(_grafted._AnswerSession, "__init__", counting)
    predictions, fits = grafted_split_predictions(judge, convs, y, splits, groups=groups)
    for got, want in zip(predictions, expected):
        np.testing.assert_array_equal(got, want)
    for fit, (locators, writers) in zip(fits, heads):
        assert [tuple(h) for h in fit["locator_heads"]] == locators
        assert [tuple(h) for h in fit["writer_heads"]] == writers
        assert len(fit["inner_mean_score"]) == 2 * len(writer_grid)
    # every prompt is read at most twice: once for the statistics, once for its grafts
    assert len(opened) <= 2 * len(convs)
    assert not hasattr(judge, "locator_heads_")  # the template is left unfitted


@pytest.mark.parametrize("name", [LLAMA, QWEN, GEMMA3])
def test_split_predictions_keep_kv_caches_on_disk_bit_for_bit(tiny, convs, name, tmp_path,
                                                              monkeypatch):
    from skafa.baselines import _grafted, grafted_split_predictions

    groups = np.array([c.task_id for c in convs])
    y = _steps(convs)
    splits = [(np.arange(5), np.arange(5, 8)), (np.arange(3, 8), np.arange(3))]
    judge = GraftedJudge(name, locator_grid=(1, 2), writer_grid=(1,), cv=GroupKFold(2))
    if name == GEMMA3:  # sliding windows rerun the prompt per graft: one pair keeps it quick
        judge.set_params(locator_grid=(1,))
    expected, fits = grafted_split_predictions(judge, convs, y, splits, groups=groups)
    reads, kept = [], []
    real_init, real_put = _grafted._AnswerSession.__init__, _grafted._KVSpill.put

    def counting(self, lm, prefix, *args, cache=None, **kwargs):
        reads.append(cache is None)
        real_init(self, lm, prefix, *args, cache=cache, **kwargs)

    def put(self, i, cache):
        real_put(self, i, cache)
        kept.append(sorted(p.name for p in self.dir.iterdir()))

    monkeypatch.setattr(_grafted._AnswerSession, "__init__", counting)
    monkeypatch.setattr(_grafted._KVSpill, "put", put)
    kv_dir = tmp_path / "kv"
    got, got_fits = grafted_split_predictions(judge, convs, y, splits, groups=groups,
                                              kv_dir=kv_dir)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert got_fits == fits
    assert list(kv_dir.iterdir()) == []  # the private subfolder is gone
    if name == GEMMA3:  # sliding windows: nothing to keep, each prompt reread
        assert kept == []
    else:  # every prompt read once; its cache waited on disk for the grafts
        assert sum(reads) == len(convs) and len(reads) == 2 * len(convs)
        assert len(kept) == len(convs) and kept[-1] == [f"{i}.safetensors"
                                                        for i in sorted(range(len(convs)),
                                                                        key=str)]


def test_kv_spill_refuses_a_changed_file_and_cleans_up_after_an_error(tiny, convs, tmp_path,
                                                                       monkeypatch):
    from safetensors.torch import save_file

    from skafa.baselines import _grafted, grafted_split_predictions

    lm, _ = load_model(LLAMA)
    ids = torch.arange(5)[None]
    with torch.inference_mode():
        cache = lm(input_ids=ids, use_cache=True).past_key_values
    spill = _grafted._KVSpill(tmp_path)
    spill.put(0, cache)
    restored = spill.take(0, lm)
    for (k, v), (k2, v2) in zip(_grafted._cache_tensors(cache),
                                _grafted._cache_tensors(restored)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert list(spill.dir.iterdir()) == []  # taken: its file is deleted
    spill.put(1, cache)
    tensors = {f"{kv}{layer}": t[:, :, :3].contiguous()
               for layer, pair in enumerate(_grafted._cache_tensors(cache))
               for kv, t in zip("kv", pair)}
    save_file(tensors, str(spill.dir / "1.safetensors"))  # another shape, same names
    with pytest.raises(RuntimeError, match="changed on disk"):
        spill.take(1, lm)
    assert spill.take(1, lm) is None
    spill.close()
    assert list(tmp_path.iterdir()) == []

    def killed(self, *args, **kwargs):
        raise RuntimeError("killed")

    monkeypatch.setattr(_grafted.GraftedJudge, "_graft_scores", killed)
    with pytest.raises(RuntimeError, match="killed"):
        grafted_split_predictions(GraftedJudge(LLAMA, locator_grid=(1,), writer_grid=(1,)),
                                  convs, _steps(convs), [(np.arange(5), np.arange(5, 8))],
                                  kv_dir=tmp_path / "kv")
    assert list((tmp_path / "kv").iterdir()) == []


def _interrupted_after_the_statistics(monkeypatch, judge, convs, y, splits, groups, store,
                                      kv_dir):
    """Run with ``keep_kv`` until the head statistics are stored, then interrupt."""
    from skafa.baselines import _grafted, grafted_split_predictions

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(_grafted.GraftedJudge, "_graft_scores", interrupted)
        with pytest.raises(KeyboardInterrupt):
            grafted_split_predictions(judge, convs, y, splits, groups=groups, store=store,
                                      kv_dir=kv_dir, keep_kv=True)
    (folder,) = kv_dir.glob("skafa-grafted-kv-*")
    return folder


def _count_reads(monkeypatch):
    """Per _AnswerSession: whether it read its prompt (no KV cache given)."""
    from skafa.baselines import _grafted

    real, reads = _grafted._AnswerSession.__init__, []

    def counting(self, lm, prefix, *args, cache=None, **kwargs):
        reads.append(cache is None)
        real(self, lm, prefix, *args, cache=cache, **kwargs)

    monkeypatch.setattr(_grafted._AnswerSession, "__init__", counting)
    return reads


@pytest.mark.parametrize("name", [LLAMA, QWEN])
def test_keep_kv_resumes_the_graft_pass_without_reading_a_prompt_again(tiny, convs, name,
                                                                        tmp_path, monkeypatch):
    """Interrupted after its head statistics, a keep_kv run resumed from its store reads
    no prompt again and predicts what an uninterrupted run predicts, bit for bit."""
    from skafa.baselines import grafted_split_predictions

    groups, y, splits, judge = _split_case(convs)
    judge.set_params(model=name)
    expected, fits = grafted_split_predictions(judge, convs, y, splits, groups=groups,
                                               store=tmp_path / "plain.json")
    store, kv_dir = tmp_path / "graft.json", tmp_path / "kv"
    folder = _interrupted_after_the_statistics(monkeypatch, judge, convs, y, splits, groups,
                                               store, kv_dir)
    assert len(json.loads(store.read_text())["stats"]) == len(convs)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{i}.safetensors" for i in range(len(convs)))
    reads = _count_reads(monkeypatch)
    got, got_fits = grafted_split_predictions(judge, convs, y, splits, groups=groups,
                                              store=store, kv_dir=kv_dir, keep_kv=True)
    assert _same(got, expected) and got_fits == fits
    assert len(reads) == len(convs) and not any(reads)  # every cache restored, none reread
    assert list(kv_dir.iterdir()) == []  # every file taken, the folder removed


def test_keep_kv_refuses_every_damaged_or_foreign_file_and_rereads_its_prompt(
        tiny, convs, tmp_path, monkeypatch):
    """Flipped bytes, another store's file, a wrong shape, garbage and a link: each is
    refused with a warning naming the conversation, deleted (the link, not its target), and
    its prompt read again; the predictions stay those of an uninterrupted run."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from skafa.baselines import grafted_split_predictions

    groups, y, splits, judge = _split_case(convs)
    expected, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups)
    store, kv_dir = tmp_path / "graft.json", tmp_path / "kv"
    folder = _interrupted_after_the_statistics(monkeypatch, judge, convs, y, splits, groups,
                                               store, kv_dir)
    data = bytearray((folder / "0.safetensors").read_bytes())
    data[-3] ^= 0x55  # one value of the last tensor changed
    (folder / "0.safetensors").write_bytes(bytes(data))
    with safe_open(str(folder / "1.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(folder / "1.safetensors"), metadata={**meta, "store": "0" * 64})
    with safe_open(str(folder / "2.safetensors"), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file({k: t[:, :, :-1].contiguous() for k, t in tensors.items()},
              str(folder / "2.safetensors"), metadata=meta)  # one token short
    (folder / "3.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}garbage")
    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes((folder / "4.safetensors").read_bytes())
    (folder / "4.safetensors").unlink()
    (folder / "4.safetensors").symlink_to(target)
    reads = _count_reads(monkeypatch)
    with pytest.warns(RuntimeWarning, match="refused") as caught:
        got, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups, store=store,
                                           kv_dir=kv_dir, keep_kv=True)
    assert _same(got, expected)
    refused = sorted(str(w.message).split(" of conversation ")[1].split(" ")[0]
                     for w in caught if "refused" in str(w.message))
    assert refused == ["0", "1", "2", "3", "4"]
    assert sum(reads) == 5 and len(reads) == len(convs)
    assert target.is_file() and list(kv_dir.iterdir()) == []
    messages = " ".join(str(w.message) for w in caught)
    for why in ("SHA-256 differs", "'store'", "shaped", "unreadable", "not a plain file"):
        assert why in messages, why


def test_a_kept_cache_another_process_took_is_read_again_not_an_error(tiny, tmp_path):
    """In a shared resumable folder another process may take (and delete) a file this one
    wrote: take() then gives None (the prompt is reread) instead of failing."""
    from skafa.baselines import _grafted

    lm, _ = load_model(LLAMA)
    ids = torch.arange(5)[None]
    with torch.inference_mode():
        cache = lm(input_ids=ids, use_cache=True).past_key_values
    prompts = [np.arange(6), np.arange(6)]
    mine = _grafted._KVSpill(tmp_path, resumable="ab" * 32, prompts=prompts)
    other = _grafted._KVSpill(tmp_path, resumable="ab" * 32, prompts=prompts)
    mine.put(0, cache)
    restored = other.take(0, lm)  # checked and taken by the other process
    assert restored is not None and other.refused == 0
    assert mine.take(0, lm) is None and not mine.dir.joinpath("0.safetensors").exists()


def test_keep_kv_is_checked(tiny, convs, tmp_path):
    from skafa.baselines import _grafted, grafted_split_predictions

    groups, y, splits, judge = _split_case(convs)
    with pytest.raises(ValueError, match="needs both store and kv_dir"):
        grafted_split_predictions(judge, convs, y, splits, groups=groups, kv_dir=tmp_path,
                                  keep_kv=True)
    with pytest.raises(TypeError, match="keep_kv must be a bool"):
        grafted_split_predictions(judge, convs, y, splits, groups=groups, keep_kv="yes")
    (tmp_path / "real").mkdir()
    (tmp_path / "skafa-grafted-kv-0123456789abcdef").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="not a folder"):
        _grafted._KVSpill(tmp_path, resumable="0123456789abcdef" * 4, prompts=[])


def test_keep_kv_removes_what_killed_writers_of_this_host_left_half_written(tmp_path):
    """A ``.partial`` file of a process of this host that no longer runs is removed when a
    resumable folder is opened; a live writer's and another host's are left alone."""
    import os

    from skafa.baselines import _grafted

    digest = "0123456789abcdef" * 4
    folder = tmp_path / f"skafa-grafted-kv-{digest[:16]}"
    folder.mkdir()
    host, pid, start = _grafted._KVSpill._writer_tag().split("-")
    if start == "None":
        pytest.skip("no /proc: liveness of a writer cannot be told")
    dead = folder / f".3.{host}-{pid}-{int(start) + 1}.partial"  # this pid, another start
    live = folder / f".4.{host}-{os.getpid()}-{start}.partial"
    other = folder / f".5.ffffffff-{pid}-1.partial"
    for path in (dead, live, other):
        path.write_bytes(b"half")
    _grafted._KVSpill(tmp_path, resumable=digest, prompts=[])
    assert not dead.exists() and live.exists() and other.exists()


def test_split_predictions_validate_like_fit(tiny, convs):
    from skafa.baselines import grafted_split_predictions

    with pytest.raises(TypeError, match="GraftedJudge"):
        grafted_split_predictions(PromptedJudge(LLAMA), convs, splits=[])
    with pytest.raises(ValueError, match="mix"):
        grafted_split_predictions(GraftedJudge(LLAMA, mix=2.0), convs,
                                  splits=[(np.arange(4), np.arange(4, 8))])


def test_split_predictions_resume_from_their_store(tiny, convs, tmp_path, monkeypatch):

    from skafa.baselines import _grafted, grafted_split_predictions
    from skafa.model_selection import ResultStoreError

    groups, y, splits, judge = _split_case(convs)
    expected, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups)
    path = tmp_path / "graft.json"
    real = _grafted._AnswerSession.step
    calls, killed = [], []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 12 and not killed:  # after the statistics, inside the grafts
            killed.append(1)
            raise RuntimeError("killed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_grafted._AnswerSession, "step", failing)
    with pytest.raises(RuntimeError, match="killed"):
        grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    kept = json.loads(path.read_text())
    assert len(kept["stats"]) == len(convs) and kept["scores"]
    calls.clear()
    got, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    resumed = len(calls)
    calls.clear()
    grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    assert calls == [] and resumed > 0  # a finished store answers everything
    # another mix, other labels, a damaged entry: refused, naming the file
    with pytest.raises(ResultStoreError, match="graft.json"):
        grafted_split_predictions(clone(judge).set_params(mix=0.5), convs, y, splits,
                                  groups=groups, store=path)
    with pytest.raises(ResultStoreError, match="other conversations"):
        grafted_split_predictions(judge, convs, (y + 1) % 2, splits, groups=groups,
                                  store=path)
    for damage in ({"stats": [[99, [], []]]}, {"scores": [[0, [[7, 0]], [[0, 0]], [0.0]]]},
                   {"scores": [[0, [[0, 0]], [[0, 1]], [0.0]]]}, {"version": 9}):
        bad = dict(kept, **damage)
        path.write_text(json.dumps(bad))
        with pytest.raises(ResultStoreError, match="remove the file"):
            grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)


def test_recheck_graft_store_finds_equal_and_changed_scores(tiny, convs, tmp_path):

    from skafa.baselines import grafted_split_predictions, recheck_graft_store
    from skafa.model_selection import ResultStoreError

    groups, y, splits, judge = _split_case(convs)
    path = tmp_path / "graft.json"
    grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    kept = json.loads(path.read_text())
    got = recheck_graft_store(judge, convs, y, store=path, n_scorings=6)
    assert got["n_checked"] == 6 and got["n_equal"] == 6 and got["differ"] == []
    assert got["max_abs_difference"] == 0.0 and got["n_prompt_tokens"] > 0
    assert path.read_text() == json.dumps(kept)  # nothing written
    # more than the store holds: every stored graft scoring, none twice
    everything = recheck_graft_store(judge, convs, y, store=path, n_scorings=10_000)
    n_grafts = sum(1 for _, locs, wris, _ in kept["scores"] if locs and wris)
    assert everything["n_checked"] == everything["n_equal"] == n_grafts > 6
    # a stored score changed in its last bits: found, named
    order = sorted(range(len(kept["scores"])),
                   key=lambda k: (kept["scores"][k][0], kept["scores"][k][1:3]))
    k = next(k for k in order if kept["scores"][k][1] and kept["scores"][k][2])
    changed = json.loads(json.dumps(kept))
    changed["scores"][k][3][0] = float(np.nextafter(changed["scores"][k][3][0], np.inf))
    path.write_text(json.dumps(changed))
    bad = recheck_graft_store(judge, convs, y, store=path, n_scorings=10_000)
    assert bad["n_equal"] == n_grafts - 1 and len(bad["differ"]) == 1
    assert 0 < bad["max_abs_difference"] < 1e-5
    assert bad["differ"][0]["writers"] == changed["scores"][k][2]
    # the store's checks hold; a missing file is an error
    with pytest.raises(ResultStoreError, match="other conversations"):
        recheck_graft_store(judge, convs, (y + 1) % 2, store=path)
    with pytest.raises(FileNotFoundError, match="no graft store"):
        recheck_graft_store(judge, convs, y, store=tmp_path / "none.json")
    with pytest.raises(ValueError, match="n_scorings"):
        recheck_graft_store(judge, convs, y, store=path, n_scorings=0)


def test_a_graft_store_records_its_thread_counts_and_warns_on_another(tiny, convs, tmp_path,
                                                                      monkeypatch):
    import warnings

    import torch

    from skafa.baselines import _grafted, grafted_split_predictions
    from skafa.model_selection import ResultStoreError

    groups = np.array([c.task_id for c in convs])
    y = _steps(convs)
    splits = [(np.arange(5), np.arange(5, 8))]
    judge = GraftedJudge(LLAMA, locator_grid=(1,), writer_grid=(1,), cv=GroupKFold(2))
    path = tmp_path / "graft.json"
    real, calls = _grafted._AnswerSession.step, []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 10:  # inside the grafts: a store with part of them
            raise RuntimeError("killed")
        return real(self, *args, **kwargs)

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.setattr(_grafted._AnswerSession, "step", failing)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with pytest.raises(RuntimeError, match="killed"):
                grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
        assert json.loads(path.read_text())["threads"] == [1]
        monkeypatch.setattr(_grafted._AnswerSession, "step", real)
        torch.set_num_threads(2)
        with pytest.warns(RuntimeWarning, match=r"graft.json was written with \[1\] torch "
                                                r"thread\(s\) and is now continued with 2"):
            grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
        assert json.loads(path.read_text())["threads"] == [1, 2]
        with warnings.catch_warnings():  # a finished store: nothing written, no warning
            warnings.simplefilter("error", RuntimeWarning)
            grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    finally:
        torch.set_num_threads(before)
    kept = json.loads(path.read_text())
    for bad in ([0], "2", [True], [1.5]):
        path.write_text(json.dumps(dict(kept, threads=bad)))
        with pytest.raises(ResultStoreError, match="'threads' is"):
            grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    path.write_text(json.dumps({k: v for k, v in kept.items() if k != "threads"}))
    grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)  # older file


def _sessions(monkeypatch):
    """The conversations whose prompt a GraftedJudge reads, in order."""
    from skafa.baselines import _grafted

    real, seen = _grafted.GraftedJudge._session, []

    def session(self, lm, plan, i, kv=None):
        seen.append(int(i))
        return real(self, lm, plan, i, kv)

    monkeypatch.setattr(_grafted.GraftedJudge, "_session", session)
    return seen


def test_a_claimed_conversation_is_done_last_and_its_claim_removed(tiny, convs, tmp_path,
                                                                   monkeypatch):
    """Another process's claim defers a conversation; a stale one never blocks it."""
    from skafa.baselines import grafted_split_predictions

    groups, y, splits, judge = _split_case(convs)
    expected, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups)
    path = tmp_path / "graft.json"
    claims = [tmp_path / "graft.json.stats-0.claim", tmp_path / "graft.json.grafts-0.claim"]
    for claim in claims:  # left by a process that was killed
        claim.write_text("{}")
    seen = _sessions(monkeypatch)
    got, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    n = len(convs)
    assert seen[:n] == [*range(1, n), 0]  # statistics: the claimed conversation last
    assert seen[n:][-1] == 0 and sorted(seen[n:]) == list(range(n))  # grafts, too
    assert not any(c.exists() for c in claims)
    assert list(tmp_path.glob("*.claim")) == []


def _share_graft_store(path, delay, queue):
    """One of two processes filling one graft store (spawned: builds its own model)."""
    import time

    torch.set_num_threads(1)
    from skafa.baselines import _grafted, grafted_split_predictions

    tok = make_tiny_tokenizer()
    register_model(LLAMA, _sharpen(make_tiny_llama(max_position_embeddings=4096, seed=3)),
                   tok, overwrite=True)
    convs = make_conversations(8, min_turns=2, max_turns=6, seed=7)
    real, seen = _grafted.GraftedJudge._session, []

    def session(self, lm, plan, i, kv=None):
        seen.append(int(i))
        time.sleep(delay)  # slow enough for the two processes to overlap
        return real(self, lm, plan, i, kv)

    _grafted.GraftedJudge._session = session
    groups, y, splits, judge = _split_case(convs)
    got, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    queue.put(([p.tolist() for p in got], seen))


def test_two_processes_share_a_graft_store(tiny, convs, tmp_path):
    """Two processes on one store split the conversations and give the same predictions."""
    import multiprocessing

    from skafa.baselines import grafted_split_predictions

    groups, y, splits, judge = _split_case(convs)
    expected, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups)
    path = tmp_path / "shared.json"
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_share_graft_store, args=(path, 0.3, queue))
               for _ in range(2)]
    for w in workers:
        w.start()
    results = [queue.get(timeout=300) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    n = len(convs)
    for predictions, seen in results:
        assert predictions == [p.tolist() for p in expected]
        assert 0 < len(seen) < 2 * n  # each read some prompts, neither all of both passes
    assert sum(len(seen) for _, seen in results) < 3 * n  # shared, not each doing all
    kept = json.loads(path.read_text())
    assert sorted(e[0] for e in kept["stats"]) == list(range(n)) and kept["threads"] == [1]
    assert list(tmp_path.glob("*.claim")) == []


def test_the_graft_pass_takes_the_prompts_whose_kv_it_kept_first(tiny, convs, tmp_path,
                                                                  monkeypatch):
    """With ``kv_dir``, conversations read here for the statistics are grafted first."""
    from skafa.baselines import grafted_split_predictions

    groups, y, splits, judge = _split_case(convs)
    path = tmp_path / "graft.json"
    expected, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    data = json.loads(path.read_text())  # an earlier run kept the statistics of 0 and 1 only
    data["stats"] = [entry for entry in data["stats"] if entry[0] in (0, 1)]
    data["scores"] = []
    path.write_text(json.dumps(data))
    seen = _sessions(monkeypatch)
    got, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path,
                                       kv_dir=tmp_path / "kv")
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    n = len(convs)
    assert seen[:n - 2] == list(range(2, n))  # statistics of the others, caches kept
    assert seen[n - 2:] == [*range(2, n), 0, 1]  # grafts: kept caches first, then rereads
    assert list((tmp_path / "kv").iterdir()) == []


def test_head_statistics_show_a_flop_weighted_bar_of_this_process_s_work(tiny, convs,
                                                                        tmp_path, monkeypatch):
    """With verbose, the statistics pass shows a WorkBar over every prompt's forward FLOPs;
    conversations found in the store leave its total (elsewhere), all are counted done."""
    from skafa.baselines import grafted_split_predictions
    from skafa.utils import progress

    groups, y, splits, judge = _split_case(convs)
    path = tmp_path / "graft.json"
    grafted_split_predictions(judge, convs, y, splits, groups=groups, store=path)
    data = json.loads(path.read_text())  # an earlier run kept the statistics of 0 and 1 only
    data["stats"] = [entry for entry in data["stats"] if entry[0] in (0, 1)]
    path.write_text(json.dumps(data))
    bars = []

    class Recording(progress.WorkBar):
        def __init__(self, cost, desc, **kwargs):
            super().__init__(cost, desc, **kwargs)
            self.log = {"cost": list(self.cost), "desc": desc, "elsewhere": [], "done": []}
            bars.append(self.log)

        def elsewhere(self, j, flag=True):
            self.log["elsewhere"].append(int(j))
            super().elsewhere(j, flag)

        def done(self, j):
            self.log["done"].append(int(j))
            super().done(j)

    monkeypatch.setattr(progress, "WorkBar", Recording)
    grafted_split_predictions(clone(judge).set_params(verbose=1), convs, y, splits,
                              groups=groups, store=path)
    (bar,) = [b for b in bars if "head statistics" in b["desc"]]
    assert len(bar["cost"]) == len(convs) and min(bar["cost"]) > 0
    assert sorted(bar["elsewhere"]) == [0, 1] and sorted(bar["done"]) == list(range(len(convs)))


def test_a_conversation_a_live_process_claims_is_waited_for(tiny, convs, tmp_path,
                                                            monkeypatch):
    """A claim held by a running process of this host is waited for, not recomputed."""
    import socket
    import subprocess
    import sys
    import threading
    import time

    from skafa.baselines import _grafted, grafted_split_predictions
    from skafa.utils import claims

    groups, y, splits, judge = _split_case(convs)
    expected, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups)
    monkeypatch.setattr(claims, "POLL_SECONDS", 0.05)
    path = tmp_path / "graft.json"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    claim = tmp_path / "graft.json.stats-0.claim"
    claim.write_text(json.dumps({"pid": other.pid, "host": socket.gethostname()}))
    assert claims.claim_holder_alive(claim)  # malformed claims: tests/utils/test_claims.py
    ended = []

    def stop_other():  # once the others' statistics are under way, and a moment longer
        while len(calls) < len(convs) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        other.kill()
        other.wait()
        ended.append(time.monotonic())

    real, calls = _grafted.GraftedJudge._session, []

    def session(self, lm, plan, i, kv=None):
        calls.append((int(i), time.monotonic()))
        return real(self, lm, plan, i, kv)

    monkeypatch.setattr(_grafted.GraftedJudge, "_session", session)
    deadline = time.monotonic() + 300
    stopper = threading.Thread(target=stop_other)
    stopper.start()
    try:
        got, _ = grafted_split_predictions(judge, convs, y, splits, groups=groups,
                                           store=path)
    finally:
        stopper.join()
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    n = len(convs)
    assert [i for i, _ in calls[:n]] == [*range(1, n), 0]
    assert calls[n - 1][1] > ended[0]  # conversation 0 only once its claimant had gone
    assert list(tmp_path.glob("*.claim")) == []


def test_a_graft_store_reads_its_file_again_only_once_it_changed(tmp_path, monkeypatch):
    """``refresh`` (called while waiting for other processes) skips an unchanged file."""
    from skafa.baselines import _grafted

    path = tmp_path / "graft.json"
    mine = _grafted._GraftStore(path, {"cell": 1}, 2, 3, [4, 4])
    mine.stats[0] = (np.zeros((2, 3)), np.ones((2, 3)))
    mine.save()
    real, reads = _grafted.read_json, []
    monkeypatch.setattr(_grafted, "read_json", lambda p: reads.append(p) or real(p))
    theirs = _grafted._GraftStore(path, {"cell": 1}, 2, 3, [4, 4])
    assert len(reads) == 1 and list(theirs.stats) == [0]
    theirs.refresh().refresh()
    assert len(reads) == 1  # nothing new on disk
    mine.stats[1] = (np.full((2, 3), 0.5), np.zeros((2, 3)))
    mine.save()  # reads the file first (it last read it before its own write)
    n = len(reads)
    theirs.refresh()
    assert len(reads) == n + 1 and sorted(theirs.stats) == [0, 1]
    np.testing.assert_array_equal(theirs.stats[1][0], np.full((2, 3), 0.5))
    theirs.refresh()
    assert len(reads) == n + 1


def test_a_graft_store_write_waits_for_another_writer(tmp_path):
    """``save`` holds a lock on the store's folder across its read-merge-write."""
    import threading

    from skafa.baselines import _grafted

    fcntl = pytest.importorskip("fcntl")
    path = tmp_path / "graft.json"
    store = _grafted._GraftStore(path, {"cell": 1}, 2, 3, [4, 4])
    store.stats[0] = (np.zeros((2, 3)), np.ones((2, 3)))
    other = os.open(tmp_path, os.O_RDONLY)  # another writer, mid-write
    fcntl.flock(other, fcntl.LOCK_EX)
    writer = threading.Thread(target=store.save)
    writer.start()
    writer.join(0.5)
    assert writer.is_alive() and not path.exists()
    os.close(other)
    writer.join(30)
    assert not writer.is_alive()
    assert [e[0] for e in json.loads(path.read_text())["stats"]] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graft.json"]  # no lock file
