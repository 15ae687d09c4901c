"""What a benchmark runs besides skafa's own probes: the prompted judge on the same
model (cached, resumable), the reference implementation mi4afa (``ag2.extensions.mi4afa``)
on the same model object, their extraction cost, and joblib's Dask backend."""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import threading
from pathlib import Path

import numpy as np

from ..baselines import PromptedJudge
from ..llm import (
    PromptTemplate,
    TurnActivationTransformer,
    banded_sliding_window_attention,
    context_length,
    conversation_content,
    forward_flops,
    has_sliding_window,
    identity_matches,
    load_model,
)
from ..model_selection import (
    JudgeScoreStore,
    ResultStoreError,
    read_json,
    read_result,
    result_dtype,
)
from ..utils.progress import Timer, WorkBar

__all__ = ["JUDGE", "PLAIN_CHAT_TEMPLATE", "attention_note", "dask_backend",
           "earlier_judge_store", "judge_cache_head", "judge_from_result", "judge_predictions",
           "mi4afa_activations", "mi4afa_fold", "mi4afa_setup", "peak_rss_during", "peer_cost"]

#: The judge's method name in result tables.
JUDGE = "PromptedJudge (logprob)"

# skafa's plain-text rendering for base models (skafa.llm: BOS, the messages joined by a
# blank line, a newline) as a chat template, for mi4afa on a tokenizer without one.
# (newlines as expressions: chat templates render with trim_blocks, which would eat a
# literal newline after a block tag)
PLAIN_CHAT_TEMPLATE = ("{% if bos_token %}{{ bos_token }}{% endif %}{% for m in messages %}"
                       "{% if not loop.first %}{{ '\\n\\n' }}{% endif %}{{ m['content'] }}"
                       "{% endfor %}{{ '\\n' }}")


# ------------------------------------------------------------------------ judge
def judge_cache_head(judge, settings, template):
    """What every judge cache key names besides the conversation(s).

    The model's identity, its dtype (unless float32: keys written before the dtype
    entry stay valid), the prompt's fingerprint and the answer prefix.
    """
    head = {"model": judge.model_identity_ if hasattr(judge, "model_identity_")
            else settings.model,
            "prompt": template.fingerprint(), "answer_prefix": judge.answer_prefix}
    if settings.dtype != "float32":
        head["dtype"] = settings.dtype
    return head


def earlier_judge_store(path, head, model):
    """A judge score store another run wrote for the same judge, opened read-only.

    Its signature must name this judge (``head``: prompt fingerprint, answer prefix,
    dtype) and the model ``model`` refers to; an identity written before 2026-12-04
    (a GGUF file named by size and first and last MiB) is recognised
    (:func:`skafa.llm.identity_matches`). Each entry's digest was made with that
    store's own signature, so :meth:`~skafa.model_selection.JudgeScoreStore.get`
    is asked with it (see :func:`judge_predictions`).

    Raises
    ------
    ResultStoreError
        Naming the file and every field that differs.
    """
    path = Path(path)
    doc = read_json(path)
    sig = doc.get("signature") if isinstance(doc, dict) else None
    if not isinstance(sig, dict):
        raise ResultStoreError(f"{path}: not a judge score store (no signature).")
    want = json.loads(json.dumps(head, sort_keys=True, default=str))
    problems = [f"{k} {sig.get(k)!r}, not {v!r}" for k, v in want.items()
                if k != "model" and sig.get(k) != v]
    if set(sig) != set(want):
        problems.append(f"fields {sorted(sig)}, not {sorted(want)}")
    if not identity_matches(sig.get("model"), model):
        problems.append(f"model {sig.get('model')!r}, not {want.get('model')!r}")
    if problems:
        raise ResultStoreError(f"judge scores from {path}: another judge: "
                               f"{'; '.join(problems)}.")
    return JudgeScoreStore(path, sig)


def judge_predictions(settings, convs, template, cache_dir, store=None, earlier=None):
    """Zero-shot judge predictions for every conversation, cached as JSON.

    Each conversation's scores are written as soon as they exist
    (``<cache_dir>/judge/<key>.json``, the key naming the model, its dtype unless
    float32, the prompt, answer prefix and the conversation), so an interrupted run
    resumes where it stopped; a file of the whole set written by earlier versions
    (``judge-<key>.json``) is still read. With ``store`` (a path), they also go to a
    :class:`~skafa.model_selection.JudgeScoreStore` kept with the results, read first.
    With ``earlier`` (a path), a judge score store another run wrote for the same
    judge is read next (:func:`earlier_judge_store`, checked; each conversation's
    entry must carry that conversation's digest), never written.
    """
    judge = PromptedJudge(model=settings.model, prompt=template, dtype=settings.dtype)
    judge.fit(convs)
    head = judge_cache_head(judge, settings, template)
    keep = JudgeScoreStore(store, head) if store is not None else None
    old = earlier_judge_store(earlier, head, settings.model) if earlier is not None else None

    def digest(extra, head=head):
        return hashlib.sha256(json.dumps({**head, **extra}, sort_keys=True,
                                         default=str).encode()).hexdigest()[:24]

    contents = [conversation_content(c) for c in convs]
    whole = Path(cache_dir) / f"judge-{digest({'convs': contents})}.json" if cache_dir else None
    if whole is not None and whole.exists():
        scores = [np.array(s) for s in json.loads(whole.read_text())]
        return np.array([int(np.argmax(s)) for s in scores])
    scores, todo = [None] * len(convs), []
    for i, (conv, content) in enumerate(zip(convs, contents)):
        key = digest({"conv": content})
        rid = conv.record_id if conv.record_id is not None else f"#{i}"
        s = keep.get(rid, key, len(conv.turns)) if keep is not None else None
        if s is None and old is not None:
            s = old.get(rid, digest({"conv": content}, old.signature), len(conv.turns))
        path = Path(cache_dir) / "judge" / f"{key}.json" if cache_dir else None
        if s is None and path is not None and path.exists():
            s = np.array(json.loads(path.read_text()))
        if s is None:
            todo.append((i, rid, key, path))
            continue
        if keep is not None and str(rid) not in keep.entries:
            keep.put(rid, key, s)
        scores[i] = np.asarray(s)
    if todo:
        # The bar weighs each conversation by its prompt's forward FLOPs (the scoring's
        # main cost), so its ETA holds although prompt lengths vary 10-fold.
        lm, tokenizer = load_model(judge.model, device=judge.device, dtype=judge.dtype_)
        n_tokens = [judge.prompt_.encode(convs[i], tokenizer,
                                         chat_template_kwargs=judge.chat_template_kwargs).n_tokens
                    for i, *_ in todo]
        with WorkBar(forward_flops(lm, n_tokens), "judge") as bar:
            for j, (i, rid, key, path) in enumerate(todo):
                s = np.asarray(judge.turn_decision_function([convs[i]])[0])
                if path is not None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(s.tolist()))
                if keep is not None:
                    keep.put(rid, key, s)
                scores[i] = s
                bar.done(j)
    return np.array([int(np.argmax(s)) for s in scores])


def judge_from_result(settings, convs, template):
    """The judge's predictions of an earlier result file, and a note saying so.

    The judge fits nothing, so its predictions depend only on the model, the prompt
    and the records. They are reused only when the earlier file names the same model
    and dtype, the same records in the same order and the same prompt fingerprint, and
    predicted the same steps in every repeat; anything else is refused
    (:class:`~skafa.model_selection.ResultStoreError`).
    """
    path = Path(settings.judge_from)
    old = read_result(path)
    problems = []
    if str(old.get("model")) != str(settings.model):
        problems.append(f"model {old.get('model')!r}, not {settings.model!r}")
    if old.get("record_ids") != [c.record_id for c in convs]:
        problems.append("other records or another order")
    old_dtype = result_dtype(old)
    if old_dtype != settings.dtype:
        problems.append(f"dtype {old_dtype}, not {settings.dtype}")
    fp = template.fingerprint()[:12]
    if f"fingerprint {fp}" not in str(old.get("prompt_note", "")):
        problems.append(f"not prompt fingerprint {fp}")
    P = np.asarray(old.get("predictions", {}).get(JUDGE, []), dtype=np.int64)
    if P.ndim != 2 or P.shape[1] != len(convs) or (P != P[:1]).any():
        problems.append(f"no {JUDGE} predictions equal across repeats")
    if problems:
        raise ResultStoreError(f"--judge-from {path}: cannot reuse its judge: "
                               f"{'; '.join(problems)}.")
    note = (f"PromptedJudge predictions reused from {path.name} ({old.get('date')}): "
            f"same model, records and prompt fingerprint {fp}; not re-run")
    return P[0], note


# ------------------------------------------------------------------------ mi4afa
def _shortened_for_peer(conv, tokenizer, template):
    enc = template.encode(conv, tokenizer)
    return list(enc.shortened_contents or [t.content for t in conv.turns])


def mi4afa_setup(model, tokenizer, convs, template, layers, n_layers):
    """mi4afa's extractor on the same model object, and its conversations.

    Conversations come from skafa's loader (speakers kept) with the turn contents
    skafa's shortening policy produced at the same budget; a prompt still longer than
    the context for mi4afa's own (longer) wording is shortened further, by 5% of the
    budget at a time, and counted. A tokenizer without a chat template (a base model)
    gets :data:`PLAIN_CHAT_TEMPLATE` in mi4afa's copy only.

    Returns ``(extractor, mi4afa conversations, number shortened further)``.
    """
    from ag2.extensions import mi4afa

    if not getattr(tokenizer, "chat_template", None):
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = PLAIN_CHAT_TEMPLATE
    sites = [mi4afa.ActivationSite(int(layer), "resid_pre") for layer in layers]
    sites.append(mi4afa.ActivationSite(int(n_layers), "resid_final"))
    extractor = mi4afa.ActivationExtractor(model, tokenizer, sites=sites)
    ctx = context_length(model)
    peer_convs, n_extra = [], 0
    for conv in convs:
        budget = template.max_prompt_tokens
        while True:  # noqa: B007
            contents = _shortened_for_peer(conv, tokenizer, PromptTemplate(
                shorten="middle_first", max_prompt_tokens=budget))
            pc = mi4afa.Conversation(
                question=conv.task, ground_truth=conv.expected_answer,
                history=tuple(mi4afa.Turn(name=t.speaker, content=c)
                              for t, c in zip(conv.turns, contents)),
                mistake_step=conv.mistake_step, mistake_agent=conv.mistake_agent)
            if len(extractor.encode(pc).input_ids) <= ctx:
                break
            budget = int(budget * 0.95)
        n_extra += budget < template.max_prompt_tokens
        peer_convs.append(pc)
    return extractor, peer_convs, n_extra


def mi4afa_activations(extractor, peer_convs, cache_dir, model_key, dtype="float32"):
    """mi4afa's activations for every conversation, cached as safetensors by content.

    mi4afa's forward passes run on the shared model object inside
    :func:`skafa.llm.banded_sliding_window_attention`, like skafa's own (a no-op
    unless the model has sliding-window layers on ``"sdpa"``). The cache key holds
    ``dtype`` unless it is float32 (so float32 entries written before the key had it
    stay valid). Activations are float32 whether they come from the cache or from a
    forward pass in another dtype, so a warm and a cold cache give the same probes.

    Returns ``(activations, seconds spent now, seconds of every record's first
    extraction)``: each cache file records how long its forward pass took.
    """
    import torch
    from ag2.extensions.mi4afa.activations import ConversationActivations
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out, seconds, recorded, todo = [None] * len(peer_convs), 0.0, 0.0, []
    folder = Path(cache_dir) / "mi4afa" if cache_dir else None
    for i, pc in enumerate(peer_convs):
        spec = {"model": model_key, "sites": [str(s) for s in extractor.sites],
                "conv": [pc.question, pc.ground_truth,
                         [[t.name, t.content] for t in pc.history]]}
        if extractor.tokenizer.chat_template == PLAIN_CHAT_TEMPLATE:  # not the model's own
            spec["chat_template"] = PLAIN_CHAT_TEMPLATE
        if str(dtype) != "float32":
            spec["dtype"] = str(dtype)
        key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]
        path = folder / f"{key}.safetensors" if folder else None
        if path is not None and path.exists():
            values = load_file(str(path))["values"]
            with safe_open(str(path), framework="pt") as f:  # seconds of the first run
                recorded += float((f.metadata() or {}).get("seconds", "nan"))
            out[i] = ConversationActivations(pc, tuple(extractor.sites), values)
        else:
            with Timer("mi4afa", None) as t:  # part of the pass's time, as in extract()
                enc = extractor.encode(pc)
            todo.append((i, path, enc, t.elapsed))
    if not todo:
        return out, seconds, recorded
    # weighted by each prompt's forward FLOPs (see skafa.utils.progress.WorkBar)
    cost = forward_flops(extractor.model, [len(enc.input_ids) for _, _, enc, _ in todo])
    with WorkBar(cost, "mi4afa: extracting activations") as bar:
        for j, (i, path, enc, encoding_s) in enumerate(todo):
            pc = peer_convs[i]
            with Timer("mi4afa", None) as t:
                with banded_sliding_window_attention(extractor.model):  # as skafa's own passes
                    acts = extractor.extract_encoded(pc, enc)
            elapsed = encoding_s + t.elapsed
            seconds += elapsed
            recorded += elapsed
            values = acts.values.to(torch.float32).contiguous()
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file({"values": values}, str(path), metadata={"seconds": f"{elapsed:.3f}"})
            out[i] = ConversationActivations(pc, tuple(extractor.sites), values)
            bar.done(j)
    return out, seconds, recorded


def mi4afa_fold(extractor, acts, train, test):
    """mi4afa's ``ProbeAttributor`` fitted on ``train``; predictions on ``test``."""
    from ag2.extensions import mi4afa

    att = mi4afa.ProbeAttributor(extractor)
    report = att.fit([acts[i] for i in train])
    pred = np.array([int(att.score_turns(acts[i]).argmax()) for i in test])
    return pred, {"site": str(report.site)}


def peak_rss_during(fn):
    """Run ``fn()``; return ``(result, seconds, peak RSS above the start in MiB)``."""
    import psutil

    proc = psutil.Process()
    start = proc.memory_info().rss
    peak = [start]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    timer = Timer("peak_rss", None)
    try:
        with timer:
            result = fn()
    finally:
        stop.set()
        th.join()
    return result, timer.elapsed, (peak[0] - start) / 2**20


def peer_cost(settings, convs, template, extractor_m, peer_convs):
    """skafa vs mi4afa extraction on the first ``settings.peer_n`` records, interleaved,
    no cache: seconds and peak extra RSS of each."""
    rows = {"skafa": [0.0, 0.0], "mi4afa": [0.0, 0.0]}
    n = min(settings.peer_n, len(convs))
    cold = TurnActivationTransformer(model=settings.model, read="last", prompt=template,
                                     dtype=settings.dtype, cache_dir=None, memory_cache=False)
    cold.fit(convs[:1])
    for i in range(n):
        _, s, mem = peak_rss_during(lambda: cold.transform([convs[i]]))  # noqa: B023
        rows["skafa"][0] += s
        rows["skafa"][1] = max(rows["skafa"][1], mem)
        with banded_sliding_window_attention(extractor_m.model):
            _, s, mem = peak_rss_during(lambda: extractor_m.extract(peer_convs[i]))  # noqa: B023
        rows["mi4afa"][0] += s
        rows["mi4afa"][1] = max(rows["mi4afa"][1], mem)
    return {k: {"seconds": round(v[0], 1), "peak_extra_rss_mib": round(v[1], 1), "n": n}
            for k, v in rows.items()}


def attention_note(model):
    """The attention implementation forward passes of this run use, in words."""
    name = getattr(model.config, "_attn_implementation", None) or "eager"
    if name == "sdpa" and has_sliding_window(model):
        return ("sdpa; sliding-window layers on their band "
                "(skafa.llm.banded_sliding_window_attention)")
    return name


@contextlib.contextmanager
def dask_backend(scheduler, log=None):
    """joblib's Dask backend on ``scheduler`` (an address or ``local:N`` for a
    ``LocalCluster`` of N single-threaded processes); a no-op for None."""
    if not scheduler:
        yield
        return
    import joblib
    from distributed import Client, LocalCluster

    with contextlib.ExitStack() as stack:
        if scheduler.startswith("local:"):
            cluster = stack.enter_context(LocalCluster(
                n_workers=int(scheduler.split(":", 1)[1]), threads_per_worker=1,
                processes=True, dashboard_address=None))
            scheduler = cluster.scheduler_address
        client = stack.enter_context(Client(scheduler))
        if log is not None:
            log(f"dask: {client}")
        stack.enter_context(joblib.parallel_config(backend="dask"))
        yield
