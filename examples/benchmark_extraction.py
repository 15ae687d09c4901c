"""Benchmark skafa's activation extraction against a bare forward pass.

Runs SmolLM2-135M-Instruct (float32, CPU) on Who&When Algorithm-Generated records
and measures, in one run, interleaving the methods record by record and repeating:

(a) a bare decoder forward pass on the same token ids, no hooks
    (``model.model(input_ids)``: embeddings, layers, final norm; no LM head);
(b) :class:`skafa.llm.TurnActivationTransformer` reading all 61 sites,
    without cache (includes rendering and tokenizing the prompt);
(c) the ``output_hidden_states=True`` approach of the design skafa grew from:
    the full causal LM forward (LM head included) keeping every layer's hidden
    states at every token, then gathering the turn positions (31 residual sites;
    ``mlp_in`` sites are not available that way);
(d) peak resident memory above the loaded model's own, per method, in fresh
    subprocesses (see ``_memory_child``);
(e) early stopping: all sites up to ``mlp_in.14`` with and without stopping the
    forward pass after the deepest needed layer;
(f) re-transforming the same records from the memory and the disk cache.

Results are written as a markdown table (default ``docs/extraction-benchmark.md``).

Two more modes:

``--peers``
    skafa next to the other ways of reading the same sites, on the same token ids
    and positions, interleaved record by record in one process (same threads):
    a bare decoder forward, skafa's ``extract_activations``, **nnsight**
    (``NNsight(model.model).trace``, ``.input`` / ``.output`` ``.save()``),
    **TransformerLens** (``TransformerBridge.boot_transformers(hf_model=...)``,
    ``run_with_cache(names_filter=...)``) and **mi4afa** (ag2's
    ``ag2.extensions.mi4afa.ActivationExtractor.extract_encoded``). Every peer's
    activations are compared with skafa's; peak extra memory is measured per
    method in a fresh process (CPU: resident set; CUDA: allocator peak).
    Needs ``pip install "torch==2.13.0" "skafa[bench]"``; a missing peer is skipped
    and named.
``--device-run``
    The GPU path: ``TurnActivationTransformer(device=..., dtype=..., batch_size=...)``
    against a bare forward in the same dtype on the same padded batches:
    tokens/s, batch sizes, peak memory, and the largest relative error of every
    site against float32 on the first records. With ``--device cpu`` and a
    half-precision ``--dtype``, a bare float32 forward on the same batches is timed in
    the same repeats (whether half precision pays on this CPU).

Usage::

    python examples/benchmark_extraction.py [--data ../shared/data/who_and_when]
        [--n 20] [--repeats 3] [--output docs/extraction-benchmark.md]
    OMP_NUM_THREADS=2 python examples/benchmark_extraction.py --peers --n 4 --repeats 2 \
        --threads 2 --output peers.md
    python examples/benchmark_extraction.py --device-run --device cuda --dtype bfloat16 \
        --model /path/qwen2.5-coder-0.5b-instruct.gguf --batch-size auto --n 40 \
        --output gpu.md

This is a script, not a test: expect tens of minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "who_and_when"


# ----------------------------------------------------------------------------- data
def load_records(data_dir, n, max_tokens, tokenizer, prompt):
    """First ``n`` Algorithm-Generated records (numeric order) whose prompt fits."""
    from skafa.conversation import Conversation

    folder = Path(data_dir) / "Algorithm-Generated"
    if not folder.is_dir():
        sys.exit(f"Who&When data not found at {folder}; pass --data.")
    files = sorted(folder.glob("*.json"), key=lambda p: (len(p.stem), p.stem))
    chosen, skipped = [], []
    for path in files:
        conv = Conversation.from_who_and_when(json.loads(path.read_text()),
                                              record_id=f"Algorithm-Generated/{path.stem}")
        enc = prompt.encode(conv, tokenizer)
        if enc.n_tokens > max_tokens:
            skipped.append((conv.record_id, enc.n_tokens))
            continue
        chosen.append((conv, enc))
        if len(chosen) == n:
            break
    return chosen, skipped


# -------------------------------------------------------------------------- methods
def bare_forward(decoder, ids):
    import torch

    with torch.inference_mode():
        decoder(input_ids=ids, use_cache=False)


def hidden_states_forward(model, ids, positions):
    """The output_hidden_states approach: full CausalLM, all layers kept, then gather."""
    import numpy as np
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        pos = torch.as_tensor(positions)
        values = torch.stack([h[0].index_select(0, pos) for h in out.hidden_states], dim=1)
    return np.ascontiguousarray(values.float().numpy())


def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _memory_child(method, record_file, data_dir):
    """Fresh process: load the model, reset the RSS high-water mark, run one record.

    Peak extra memory = VmHWM after the run minus VmRSS just before it. The
    high-water mark is reset through /proc/self/clear_refs (Linux >= 4.0) so the
    model-loading peak (GGUF dequantisation) is not counted. glibc's dynamic mmap
    threshold is pinned by the parent (MALLOC_MMAP_THRESHOLD_) so freed large
    buffers go back to the OS and do not hide later growth.
    """
    import numpy as np
    import torch

    from skafa.conversation import Conversation
    from skafa.llm import TurnActivationTransformer

    conv = Conversation.from_who_and_when(json.loads(Path(record_file).read_text()))
    t = TurnActivationTransformer("smollm2", memory_cache=False).fit([conv])
    model, tok = t._model, t._tokenizer
    enc = t.prompt_.encode(conv, tok)
    ids = torch.as_tensor(enc.input_ids)[None]
    with torch.inference_mode():  # initialise lazy state on a tiny input
        model.model(input_ids=ids[:, :8], use_cache=False)
    baseline = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if method == "bare":
        bare_forward(model.model, ids)
    elif method == "skafa":
        t.transform([conv])
    elif method == "hidden_states":
        hidden_states_forward(model, ids, np.asarray(enc.turn_positions))
    peak = _rss_kib("VmHWM")
    print(json.dumps({"method": method, "baseline_kib": baseline, "peak_kib": peak,
                      "n_tokens": int(enc.n_tokens)}))


def torch_threads():
    import torch

    return torch.get_num_threads()


def measure_memory(method, record_file, data_dir):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run(
        [sys.executable, __file__, "--_memory-child", method, "--_record", str(record_file),
         "--data", str(data_dir), "--threads", str(torch_threads())],
        capture_output=True, text=True, env=env, check=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    res = json.loads(line)
    return (res["peak_kib"] - res["baseline_kib"]) / 1024, res["n_tokens"]


# --------------------------------------------------------------------------- peers
def site_names(n_layers):
    from skafa.llm import all_sites

    return all_sites(n_layers)


def _split(site):
    kind, _, layer = site.partition(".")
    return kind, (int(layer) if layer else None)


class Skafa:
    """skafa's building block on token ids: ``extract_activations``."""

    label = "skafa `extract_activations`"
    reads = "pre-hook on layer `l` (`resid_pre`), `post_attention_layernorm` output (`mlp_in`), final norm output (`resid_final`)"

    def __init__(self, model, tokenizer, sites):
        self.model, self.sites = model, sites

    def __call__(self, ids, pos):
        from skafa.llm import extract_activations

        return extract_activations(self.model, [ids[0].cpu().numpy()], [pos.cpu().numpy()],
                                   self.sites)[0]


class Bare:
    label = "bare decoder forward, no hooks (`model.model(input_ids)`)"
    reads = "nothing"

    def __init__(self, model, tokenizer, sites):
        self.decoder = model.model

    def __call__(self, ids, pos):
        import torch

        with torch.inference_mode():
            self.decoder(input_ids=ids, use_cache=False)


class NNsightPeer:
    """nnsight 0.8: trace the base decoder, save the rows of every site."""

    label = "nnsight `NNsight(model.model).trace`, `.save()` of the turn rows"
    reads = "same modules as skafa (`layers[l].input`, `post_attention_layernorm.output`, `norm.output`)"

    def __init__(self, model, tokenizer, sites):
        from nnsight import NNsight

        self.nn = NNsight(model.model)
        self.sites = sites

    def __call__(self, ids, pos):
        import numpy as np
        import torch

        saved = []
        with torch.inference_mode(), self.nn.trace(ids, use_cache=False):
            for site in self.sites:  # nnsight wants the modules in execution order
                kind, layer = _split(site)
                if kind == "resid_pre":
                    value = self.nn.layers[layer].input
                elif kind == "mlp_in":
                    value = self.nn.layers[layer].post_attention_layernorm.output
                else:
                    value = self.nn.norm.output
                saved.append(value[0, pos].save())
        return np.stack([v.float().cpu().numpy() for v in saved], axis=1)


class TransformerLensPeer:
    """TransformerLens 4.3: TransformerBridge around a copy of the HF model."""

    label = ("TransformerLens `TransformerBridge.run_with_cache(names_filter=...)`, "
             "rows gathered after")
    reads = ("`blocks.l.hook_resid_pre`, `blocks.l.ln2.hook_out`, `ln_final.hook_out` (same "
             "points; the bridge forces eager attention and runs the LM head)")

    def __init__(self, model, tokenizer, sites):
        import copy

        from transformer_lens.model_bridge import TransformerBridge

        # The bridge replaces submodules of the model it wraps: give it its own copy.
        self.bridge = TransformerBridge.boot_transformers(
            getattr(model.config, "_name_or_path", "model") or "model",
            hf_model=copy.deepcopy(model), tokenizer=tokenizer)
        names = []
        for site in sites:
            kind, layer = _split(site)
            names.append({"resid_pre": f"blocks.{layer}.hook_resid_pre",
                          "mlp_in": f"blocks.{layer}.ln2.hook_out"}.get(kind,
                                                                         "ln_final.hook_out"))
        self.names = names
        wanted = set(names)
        self.filter = lambda name: name in wanted

    def __call__(self, ids, pos):
        import numpy as np
        import torch

        with torch.inference_mode():
            _, cache = self.bridge.run_with_cache(ids, names_filter=self.filter,
                                                  return_type=None)
            rows = [cache[n][0].index_select(0, pos).float().cpu().numpy() for n in self.names]
        return np.stack(rows, axis=1)


class Mi4afaPeer:
    """ag2 1.2.1 mi4afa: ActivationExtractor.extract_encoded on skafa's token ids."""

    label = "mi4afa (ag2) `ActivationExtractor.extract_encoded`"
    reads = ("`output_hidden_states` for `resid_pre`/`resid_final`, a pre-hook on `mlp` for "
             "`mlp_in` (same points)")

    def __init__(self, model, tokenizer, sites):
        from ag2.extensions.mi4afa import ActivationExtractor, ActivationSite

        self.extractor = ActivationExtractor(model, tokenizer)
        n = self.extractor.num_layers
        self.sites = tuple(ActivationSite(n if layer is None else layer, kind)
                           for kind, layer in map(_split, sites))

    def __call__(self, ids, pos):
        import numpy as np
        from ag2.extensions.mi4afa import Conversation, Turn
        from ag2.extensions.mi4afa.prompt import PromptEncoding

        positions = tuple(int(p) for p in pos.cpu())
        conv = Conversation(question="-", ground_truth="-",
                            history=tuple(Turn(name="agent", content="-") for _ in positions))
        enc = PromptEncoding(input_ids=tuple(int(i) for i in ids[0].cpu()),
                             turn_positions=positions)
        values = self.extractor.extract_encoded(conv, enc, sites=self.sites).values
        return np.ascontiguousarray(values.float().numpy().transpose(1, 0, 2))


PEERS = {"bare": Bare, "skafa": Skafa, "nnsight": NNsightPeer,
         "transformer_lens": TransformerLensPeer, "mi4afa": Mi4afaPeer}
PEER_PACKAGES = {"nnsight": "nnsight", "transformer_lens": "transformer_lens",
                 "mi4afa": "ag2.extensions.mi4afa"}


def _available_peers():
    import importlib

    found, missing = [], {}
    for name in PEERS:
        try:
            if name in PEER_PACKAGES:
                module = importlib.import_module(PEER_PACKAGES[name])
                version = getattr(module, "__version__", None)
                if name == "mi4afa":
                    version = importlib.import_module("ag2").__version__
                found.append((name, version))
            else:
                found.append((name, None))
        except Exception as exc:  # noqa: BLE001 - report and skip
            missing[name] = f"{type(exc).__name__}: {exc}"
    return found, missing


def _sync(device):
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _peer_memory_child(args):
    """Fresh process: load, build one method, reset the peak, run the longest record once."""
    import torch

    from skafa.llm import PromptTemplate, load_model

    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    conv = _record(args.record)
    enc = PromptTemplate().encode(conv, tok)
    ids = torch.as_tensor(enc.input_ids, device=args.device)[None]
    pos = torch.as_tensor(enc.turn_positions, device=args.device)
    method = PEERS[args.memory_child](model, tok, site_names(model.config.num_hidden_layers))
    method(ids[:, :8], torch.tensor([7], device=args.device))  # warm up lazy state
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    baseline = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    method(ids, pos)
    if cuda:
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        extra = (_rss_kib("VmHWM") - baseline) / 1024
    print(json.dumps({"method": args.memory_child, "extra_mib": extra,
                      "n_tokens": int(enc.n_tokens)}))


def _record(path):
    from skafa.conversation import Conversation

    path = Path(path)
    return Conversation.from_who_and_when(json.loads(path.read_text()),
                                          record_id=f"{path.parent.name}/{path.stem}")


def _relative_error(got, ref):
    import numpy as np

    err = np.linalg.norm(got - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    return err.max(axis=0)  # per site


def run_peers(args):
    import numpy as np
    import torch

    from skafa.llm import PromptTemplate, load_model

    started = datetime.datetime.now()
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    n_layers = model.config.num_hidden_layers
    sites = site_names(n_layers)
    prompt = PromptTemplate()
    max_tokens = args.max_tokens or model.config.max_position_embeddings
    records, skipped = load_records(args.data, args.n, max_tokens, tok, prompt)
    encs = [e for _, e in records]
    ids = [torch.as_tensor(e.input_ids, device=args.device)[None] for e in encs]
    pos = [torch.as_tensor(e.turn_positions, device=args.device) for e in encs]
    n_tokens = [int(e.n_tokens) for e in encs]
    found, missing = _available_peers()
    methods, setup_s, failed = {}, {}, {}
    for name, _ in found:
        s = time.perf_counter()
        try:
            methods[name] = PEERS[name](model, tok, sites)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot wrap the model
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        setup_s[name] = time.perf_counter() - s
    versions = dict(found)
    names = list(methods)
    print(f"{len(encs)} records, {sum(n_tokens)} tokens; methods {names}; "
          f"missing {missing}; failed {failed}", flush=True)

    for name in names:  # warm up lazy state on a short prefix
        methods[name](ids[0][:, :8], torch.tensor([7], device=args.device))
    times = {m: [[] for _ in encs] for m in names}
    outs = {m: [None] * len(encs) for m in names}
    for rep in range(args.repeats):
        for i in range(len(encs)):
            k = (rep + i) % len(names)
            for m in names[k:] + names[:k]:
                _sync(args.device)
                s = time.perf_counter()
                value = methods[m](ids[i], pos[i])
                _sync(args.device)
                times[m][i].append(time.perf_counter() - s)
                if rep == 0:
                    outs[m][i] = value
            print(f"  repeat {rep + 1} record {i + 1}/{len(encs)} ({n_tokens[i]} tokens): "
                  + ", ".join(f"{m} {times[m][i][-1]:.1f}s" for m in names), flush=True)
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
            f"{m} {sum(min(x) for x in times[m]):.1f}s" for m in names), flush=True)
    # Same values? Every peer against skafa, on every record (outputs of the first repeat).
    errors = {}
    for name in names:
        if name in ("bare", "skafa"):
            continue
        errors[name] = np.max([_relative_error(outs[name][i], outs["skafa"][i])
                               for i in range(len(encs))], axis=0)
    del outs
    best = {m: [min(x) for x in times[m]] for m in names}
    total = {m: sum(v) for m, v in best.items()}
    ratio = {m: statistics.median(a / b for a, b in zip(best[m], best["bare"])) for m in names}

    # Peak extra memory, one fresh process per method, on the longest record.
    longest = int(np.argmax(n_tokens))
    record_file = Path(args.data) / f"{records[longest][0].record_id}.json"
    mem = {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    for m in names:
        cmd = [sys.executable, __file__, "--peers", "--_memory-child", m, "--_record",
               str(record_file), "--model", str(args.model), "--device", args.device,
               "--dtype", args.dtype, "--threads", str(torch.get_num_threads())]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
        mem[m] = json.loads(lines[-1])["extra_mib"] if out.returncode == 0 and lines else None
        print(f"memory {m}: {mem[m]}", flush=True)

    load1 = os.getloadavg()
    elapsed = time.perf_counter() - t0
    cmd = "python examples/benchmark_extraction.py " + " ".join(
        a for a in sys.argv[1:] if not a.startswith("--_"))
    unit = "allocator peak (`torch.cuda.max_memory_allocated`)" if args.device.startswith(
        "cuda") else "VmHWM minus VmRSS before the pass"
    lines = [
        f"- Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} "
        f"{cmd.strip()}` (repository root); {started:%Y-%m-%d %H:%M}, {elapsed / 60:.1f} min",
        f"- Machine: {platform.platform()}, os.cpu_count()={os.cpu_count()}, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads), device {args.device}, "
        f"dtype {args.dtype}; load average at start {load0[0]:.1f}, at end {load1[0]:.1f} "
        "(shared machine: the methods are interleaved, so ratios are fairer than absolute "
        "times)",
        f"- Model: {args.model} ({n_layers} layers, loaded in {load_s:.0f} s), attention "
        f"`{model.config._attn_implementation}`; all {len(sites)} sites at every turn",
        f"- Data: the first {len(encs)} Algorithm-Generated records (numeric order) whose "
        f"prompt fits {max_tokens} tokens: {sum(len(c) for c, _ in records)} turns, "
        f"{sum(n_tokens)} tokens ({min(n_tokens)}..{max(n_tokens)}); skipped: "
        f"{', '.join(f'{r} ({n})' for r, n in skipped) or 'none'}",
        f"- Timing: {args.repeats} repeats, methods interleaved per record in rotating "
        "order, fastest repeat per record summed; every method gets skafa's token ids and "
        "turn positions (no prompt rendering is timed)",
        f"- Memory: peak extra on the longest record ({n_tokens[longest]} tokens), fresh "
        f"process per method, {unit}",
        "",
        "| method | reads | time (s) | vs bare (total) | vs bare (median per record) | "
        "tokens/s | peak extra memory (MiB) | max relative error vs skafa |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in names:
        cls = PEERS[m]
        err = ("—" if m == "bare" else "0 (reference)" if m == "skafa"
               else f"{errors[m].max():.1e}")
        mm = "failed" if mem[m] is None else f"{mem[m]:.0f}"
        version = f" ({versions[m]})" if versions.get(m) else ""
        lines.append(f"| {cls.label}{version} | {cls.reads} | {total[m]:.1f} | "
                     f"{total[m] / total['bare']:.3f} | {ratio[m]:.3f} | "
                     f"{sum(n_tokens) / total[m]:.0f} | {mm} | {err} |")
    lines.append("")
    for m, e in errors.items():
        worst = int(np.argmax(e))
        lines.append(f"- {m}: largest relative error (L2 of a turn vector) {e.max():.1e} at "
                     f"`{sites[worst]}`; median over sites {np.median(e):.1e}.")
    for m, why in {**missing, **failed}.items():
        lines.append(f"- {m}: not run ({why}).")
    text = "\n".join(lines) + "\n"
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)


# -------------------------------------------------------------------------- device
def run_device(args):
    """Batched extraction on a device against a bare forward on the same batches."""
    import numpy as np
    import torch

    from skafa.llm import PromptTemplate, TurnActivationTransformer, decoder_layout, load_model
    from skafa.llm._extraction import _auto_batches, _batches

    started = datetime.datetime.now()
    cuda = torch.device(args.device).type == "cuda"
    t0 = time.perf_counter()
    model, tok = load_model(args.model, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    layout = decoder_layout(model)
    prompt = PromptTemplate()
    max_tokens = args.max_tokens or model.config.max_position_embeddings
    records, skipped = load_records(args.data, args.n, max_tokens, tok, prompt)
    convs = [c for c, _ in records]
    encs = [e for _, e in records]
    lengths = [int(e.n_tokens) for e in encs]
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    batches = (_auto_batches(lengths, layout, layout.embedding.weight.device)
               if batch_size == "auto" else _batches(lengths, batch_size))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # In another dtype, a bare float32 forward on the same batches and device is timed in
    # the same interleaved repeats: what the half-precision path buys on this machine.
    half = torch.device(args.device).type == "cpu" and str(args.dtype) not in (
        "float32", "torch.float32")
    decoders = {"bare": layout.decoder}
    if half:
        decoders["bare float32"] = decoder_layout(
            load_model(args.model, device=args.device, dtype="float32")[0]).decoder

    def bare(decoder):
        with torch.inference_mode():
            for batch in batches:
                width = max(lengths[i] for i in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for b, i in enumerate(batch):
                    ids[b, :lengths[i]] = torch.as_tensor(encs[i].input_ids)
                    mask[b, :lengths[i]] = 1
                decoder(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                        use_cache=False)

    def skafa_run():
        t = TurnActivationTransformer(args.model, device=args.device, dtype=args.dtype,
                                      batch_size=batch_size, memory_cache=False).fit(convs)
        return t, t.transform(convs)

    order = [*decoders, "skafa"]
    results = {name: [] for name in order}
    peaks = {}
    for rep in range(args.repeats):
        for name in (order if rep % 2 == 0 else order[::-1]):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            s = time.perf_counter()
            out = skafa_run() if name == "skafa" else bare(decoders[name])
            _sync(args.device)
            results[name].append(time.perf_counter() - s)
            if cuda:
                peaks[name] = max(peaks.get(name, 0),
                                  (torch.cuda.max_memory_allocated() - base) / 2**20)
            if name == "skafa":
                extractor, X = out
        print(f"repeat {rep + 1}: " + ", ".join(f"{name} {results[name][-1]:.2f}s"
                                                for name in order), flush=True)
    tokens = sum(lengths)
    bare_s, skafa_s = min(results["bare"]), min(results["skafa"])

    # Against float32 on the first records (CPU float32 when the device is not the CPU).
    k = min(len(convs), 5)
    ref = TurnActivationTransformer(args.model, dtype="float32", memory_cache=False,
                                    batch_size=1).fit(convs[:k]).transform(convs[:k])
    got = X.values[: ref.values.shape[0]]
    err = _relative_error(got, ref.values)
    sizes = [len(b) for b in batches]
    lines = [
        f"- Command: `python examples/benchmark_extraction.py "
        f"{' '.join(a for a in sys.argv[1:] if not a.startswith('--_'))}`; "
        f"{started:%Y-%m-%d %H:%M}",
        f"- Machine: {platform.platform()}, torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if cuda else "")
        + f", dtype {args.dtype}, attention `{model.config._attn_implementation}`",
        f"- Model: {args.model}, {model.config.num_hidden_layers} layers x "
        f"{model.config.hidden_size}, loaded in {load_s:.0f} s",
        f"- Data: {len(convs)} records, {tokens} tokens ({min(lengths)}..{max(lengths)}); "
        f"batches: {len(batches)} (sizes {min(sizes)}..{max(sizes)}, batch_size={batch_size!r})",
        "",
        "| method | time (s) | tokens/s | vs bare | peak extra memory (MiB) |",
        "|---|---:|---:|---:|---:|",
        f"| bare forward, same batches and dtype | {bare_s:.2f} | {tokens / bare_s:.0f} | 1.000 "
        f"| {peaks.get('bare', float('nan')):.0f} |",
        f"| skafa `TurnActivationTransformer` (fit + transform, all sites, incl. rendering) | "
        f"{skafa_s:.2f} | {tokens / skafa_s:.0f} | {skafa_s / bare_s:.3f} | "
        f"{peaks.get('skafa', float('nan')):.0f} |",
        *([(f"| bare forward, same batches, float32 | {min(results['bare float32']):.2f} | "
            f"{tokens / min(results['bare float32']):.0f} | "
            f"{min(results['bare float32']) / bare_s:.3f} | nan |")] if half else []),
        "",
        f"{args.dtype} vs float32 on the first {k} records: largest relative error of a turn "
        f"vector {err.max():.2e} (at `{extractor.sites_[int(np.argmax(err))]}`), median over "
        f"sites {np.median(err):.2e}.",
        "",
    ]
    text = "\n".join(lines)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(text)
    print(text)


# ---------------------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--n", type=int, default=20, help="number of records")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="skip records with longer prompts (default: context length)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's default); on a machine shared "
                             "with other jobs, 1 thread avoids OpenMP oversubscription")
    parser.add_argument("--output", default=str(REPO / "docs" / "extraction-benchmark.md"))
    parser.add_argument("--peers", action="store_true",
                        help="skafa vs bare forward, nnsight, TransformerLens, mi4afa")
    parser.add_argument("--device-run", action="store_true",
                        help="batched GPU path (--device, --dtype, --batch-size) vs bare forward")
    parser.add_argument("--model", default="smollm2",
                        help="--peers/--device-run: model name or path (skafa.llm._models)")
    parser.add_argument("--device", default="cpu", help="--peers/--device-run: torch device")
    parser.add_argument("--dtype", default="float32", help="--peers/--device-run: dtype")
    parser.add_argument("--batch-size", default="auto",
                        help="--device-run: an int or 'auto' (default)")
    parser.add_argument("--_memory-child", dest="memory_child", default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--_record", dest="record", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import numpy as np
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child and args.peers:
        return _peer_memory_child(args)
    if args.memory_child:
        return _memory_child(args.memory_child, args.record, args.data)
    if args.peers:
        return run_peers(args)
    if args.device_run:
        return run_device(args)

    from skafa.llm import TurnActivationTransformer, all_sites, extract_activations

    started = datetime.datetime.now()
    load0 = os.getloadavg()
    from skafa.llm import PromptTemplate, load_model

    t0 = time.perf_counter()

    model, tok = load_model("smollm2")
    load_s = time.perf_counter() - t0
    prompt = PromptTemplate()
    max_tokens = args.max_tokens or model.config.max_position_embeddings
    records, skipped = load_records(args.data, args.n, max_tokens, tok, prompt)
    convs = [c for c, _ in records]
    encs = [e for _, e in records]
    ids = [torch.as_tensor(e.input_ids)[None] for e in encs]
    positions = [np.asarray(e.turn_positions) for e in encs]
    n_tokens = [int(e.n_tokens) for e in encs]
    print(f"model loaded in {load_s:.1f}s; {len(convs)} records, {sum(n_tokens)} tokens "
          f"(skipped as too long: {skipped})", flush=True)

    t_plain = TurnActivationTransformer("smollm2", memory_cache=False).fit(convs)
    cache_dir = tempfile.mkdtemp(prefix="skafa-bench-cache-")
    t_cached = TurnActivationTransformer("smollm2", cache_dir=cache_dir).fit(convs)
    decoder = model.model

    # Warm up every path on the shortest record.
    k = int(np.argmin(n_tokens))
    bare_forward(decoder, ids[k])
    hidden_states_forward(model, ids[k], positions[k])
    t_plain.transform([convs[k]])

    def encode_time(i):
        s = time.perf_counter()
        prompt.encode(convs[i], tok)
        return time.perf_counter() - s

    methods = {
        "bare": lambda i: bare_forward(decoder, ids[i]),
        "skafa": None,  # set per repeat (first repeat fills the cache)
        "hidden_states": lambda i: hidden_states_forward(model, ids[i], positions[i]),
    }
    times = {m: [[] for _ in convs] for m in methods}
    enc_times = [[] for _ in convs]
    names = list(methods)
    for rep in range(args.repeats):
        extractor = t_cached if rep == 0 else t_plain
        methods["skafa"] = lambda i, ex=extractor: ex.transform([convs[i]])
        for i in range(len(convs)):
            order = names[(rep + i) % 3:] + names[:(rep + i) % 3]
            for m in order:
                s = time.perf_counter()
                methods[m](i)
                times[m][i].append(time.perf_counter() - s)
            enc_times[i].append(encode_time(i))
        done = {m: sum(statistics.median(x) for x in times[m]) for m in names}
        print(f"repeat {rep + 1}/{args.repeats}: " +
              ", ".join(f"{m} {v:.1f}s" for m, v in done.items()), flush=True)
    assert t_cached.run_stats["n_forward_passes"] == len(convs)

    med = {m: [statistics.median(x) for x in times[m]] for m in names}
    total = {m: sum(v) for m, v in med.items()}
    per_record_ratio = {m: statistics.median(a / b for a, b in zip(med[m], med["bare"]))
                        for m in names}
    enc_total = sum(statistics.median(x) for x in enc_times)

    # (e) early stop: sites up to mlp_in.14 of 30 layers, 5 records.
    half = all_sites(30)[: 2 * 15]
    es = {True: [[] for _ in range(5)], False: [[] for _ in range(5)]}
    subset = list(range(min(5, len(convs))))
    for rep in range(args.repeats):
        for i in subset:
            for flag in ((True, False) if (rep + i) % 2 == 0 else (False, True)):
                s = time.perf_counter()
                extract_activations(model, [encs[i].input_ids], [positions[i]], half,
                                    early_stop=flag)
                es[flag][i].append(time.perf_counter() - s)
    es_total = {f: sum(statistics.median(x) for x in es[f][: len(subset)]) for f in es}
    es_bare = sum(med["bare"][i] for i in subset)

    # (f) cached re-transform: memory, then disk from a fresh transformer.
    mem_t, disk_t = [], []
    for _ in range(5):
        s = time.perf_counter()
        t_cached.transform(convs)
        mem_t.append(time.perf_counter() - s)
        fresh = TurnActivationTransformer("smollm2", cache_dir=cache_dir,
                                          memory_cache=False).fit(convs)
        s = time.perf_counter()
        fresh.transform(convs)
        disk_t.append(time.perf_counter() - s)
        assert fresh.run_stats["n_forward_passes"] == 0
    assert t_cached.run_stats["n_forward_passes"] == len(convs)

    # (d) memory, fresh subprocesses, on the longest record.
    longest = int(np.argmax(n_tokens))
    record_file = Path(args.data) / f"{convs[longest].record_id}.json"
    mem = {}
    for m in names:
        mem[m], _ = measure_memory(m, record_file, args.data)
        print(f"memory {m}: +{mem[m]:.0f} MiB", flush=True)
    t_long = n_tokens[longest]
    held_hidden = 31 * t_long * 576 * 4 / 2**20
    held_logits = t_long * model.config.vocab_size * 4 / 2**20

    load1 = os.getloadavg()
    elapsed = time.perf_counter() - t0
    tokens = sum(n_tokens)
    turns = sum(len(c) for c in convs)
    cmd = "python examples/benchmark_extraction.py " + " ".join(
        a for a in sys.argv[1:] if not a.startswith("--_"))
    lines = [
        "# Extraction benchmark",
        "",
        f"- Command: `{cmd.strip()}` (run from the repository root)",
        f"- Date: {started:%Y-%m-%d %H:%M}; total run time {elapsed / 60:.1f} min",
        f"- Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"os.cpu_count()={os.cpu_count()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), attention `{model.config._attn_implementation}`",
        f"- Load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
        f"at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} (the machine is shared; "
        "interleaving keeps the ratios fair, absolute times vary with the load)",
        f"- Model: SmolLM2-135M-Instruct Q4_1 GGUF dequantised to float32, CPU; loaded in "
        f"{load_s:.1f} s",
        f"- Data: the first {len(convs)} Algorithm-Generated records (numeric order) whose "
        f"prompt fits {max_tokens} tokens; {turns} turns, {tokens} prompt tokens "
        f"(min {min(n_tokens)}, median {int(np.median(n_tokens))}, max {max(n_tokens)}). "
        f"Skipped as too long: {', '.join(f'{r} ({n} tokens)' for r, n in skipped) or 'none'}.",
        f"- Timing: {args.repeats} repeats, methods interleaved per record in rotating "
        "order; per-record median, summed over records. The first repeat of (b) also "
        "writes the memory and disk cache.",
        "",
        "| method | time (s) | vs (a) total | vs (a) median per record | tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    labels = {
        "bare": "(a) bare decoder forward, no hooks (`model.model(input_ids)`)",
        "skafa": "(b) skafa `TurnActivationTransformer`, all 61 sites, no cache "
                 "(incl. prompt rendering + tokenization)",
        "hidden_states": "(c) `output_hidden_states=True` on the CausalLM (LM head incl.), "
                         "31 residual sites gathered",
    }
    for m in names:
        lines.append(f"| {labels[m]} | {total[m]:.1f} | {total[m] / total['bare']:.3f} | "
                     f"{per_record_ratio[m]:.3f} | {tokens / total[m]:.0f} |")
    lines += [
        f"| (b) minus prompt rendering/tokenization ({enc_total:.2f} s) | "
        f"{total['skafa'] - enc_total:.1f} | "
        f"{(total['skafa'] - enc_total) / total['bare']:.3f} | | |",
        "",
        "Early stopping (sites `resid_pre.0` .. `mlp_in.14`, i.e. half the layers, "
        f"{len(subset)} records, `extract_activations`):",
        "",
        "| variant | time (s) | vs (a) on the same records |",
        "|---|---:|---:|",
        f"| stop after `mlp_in.14` (default) | {es_total[True]:.1f} | "
        f"{es_total[True] / es_bare:.3f} |",
        f"| run all 30 layers | {es_total[False]:.1f} | {es_total[False] / es_bare:.3f} |",
        "",
        f"Cached re-transform of all {len(convs)} records (median of 5):",
        "",
        "| cache | time (s) | per conversation (ms) |",
        "|---|---:|---:|",
        f"| memory (process-wide LRU) | {statistics.median(mem_t):.4f} | "
        f"{1000 * statistics.median(mem_t) / len(convs):.2f} |",
        f"| disk (fresh transformer, safetensors, OS page cache warm) | "
        f"{statistics.median(disk_t):.4f} | {1000 * statistics.median(disk_t) / len(convs):.2f} |",
        "",
        f"Peak resident memory above the loaded model's (longest record: "
        f"{convs[longest].record_id}, {t_long} tokens; fresh subprocess per method; "
        "VmHWM after the pass minus VmRSS before it, high-water mark reset through "
        "`/proc/self/clear_refs` after loading; `MALLOC_MMAP_THRESHOLD_=131072`):",
        "",
        "| method | peak extra RSS (MiB) |",
        "|---|---:|",
    ]
    for m in names:
        lines.append(f"| {labels[m]} | {mem[m]:.0f} |")
    lines += [
        "",
        f"For scale at {t_long} tokens: all 31 residual hidden states take "
        f"{held_hidden:.0f} MiB and the logits {held_logits:.0f} MiB (float32); skafa "
        f"keeps {len(convs[longest]) * 61 * 576 * 4 / 2**20:.2f} MiB of activations for "
        "that conversation.",
        "",
    ]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
