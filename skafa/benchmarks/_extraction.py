"""The extraction benchmark: skafa's activation extraction next to a bare forward pass,
the ``output_hidden_states`` approach and the other libraries that read the same sites
(nnsight, TransformerLens, mi4afa), interleaved record by record in one process; and
the batched device path against a bare forward on the same padded batches.

Each ``run_*`` function returns a dict whose ``"markdown"`` is the report;
``examples/benchmark_extraction.py`` is its command line. Peak memory is measured in a
fresh process per method (:func:`measure_peak_memory`).
"""

# Authors: The skafa developers
# SPDX-License-Identifier: MIT

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..conversation import Conversation
from ..utils.signals import raise_if_stop_requested, stop_requests
from ._who_and_when import _say

__all__ = ["EXTRACTION_PEERS", "ExtractionBenchmarkSettings", "first_records",
           "measure_peak_memory", "run_device_benchmark", "run_extraction_benchmark",
           "run_peers_benchmark"]


@dataclasses.dataclass
class ExtractionBenchmarkSettings:
    """What one extraction benchmark run reads and how often.

    ``data`` is the Who&When folder (its ``Algorithm-Generated`` records are read in
    numeric order); ``n`` records whose prompt fits ``max_tokens`` (default: the
    model's context) are timed ``repeats`` times. ``model``/``device``/``dtype`` are
    used by the peers and device runs (the plain run reads ``model`` on the CPU in its
    default dtype); ``batch_size`` (an int or ``"auto"``) by the device run.
    ``command`` is the command line the report names.
    """

    data: str
    n: int = 20
    repeats: int = 3
    max_tokens: int | None = None
    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: object = "auto"
    command: str = "python examples/benchmark_extraction.py"


# ----------------------------------------------------------------------------- data
def _record(path, record_id=None):
    path = Path(path)
    return Conversation.from_who_and_when(
        json.loads(path.read_text()), labelled=True,
        record_id=record_id if record_id is not None else f"{path.parent.name}/{path.stem}")


def first_records(data_dir, n, max_tokens, tokenizer, prompt):
    """The first ``n`` Algorithm-Generated records (numeric order) whose prompt fits.

    Returns ``(chosen, skipped)``: ``[(conversation, encoding)]`` and
    ``[(record id, n_tokens)]`` of the records passed over as too long.
    """
    folder = Path(data_dir) / "Algorithm-Generated"
    if not folder.is_dir():
        raise FileNotFoundError(f"Who&When data not found at {folder}; pass --data.")
    files = sorted(folder.glob("*.json"), key=lambda p: (len(p.stem), p.stem))
    chosen, skipped = [], []
    for path in files:
        conv = _record(path, f"Algorithm-Generated/{path.stem}")
        enc = prompt.encode(conv, tokenizer)
        if enc.n_tokens > max_tokens:
            skipped.append((conv.record_id, enc.n_tokens))
            continue
        chosen.append((conv, enc))
        if len(chosen) == n:
            break
    return chosen, skipped


def _relative_error(got, ref):
    """Largest relative L2 error of a turn vector, per site."""
    err = np.linalg.norm(got - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)
    return err.max(axis=0)


def _sync(device):
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _command(settings):
    return settings.command.strip()


# -------------------------------------------------------------------------- methods
def _bare_forward(decoder, ids):
    import torch

    with torch.inference_mode():
        decoder(input_ids=ids, use_cache=False)


def _hidden_states_forward(model, ids, positions):
    """The output_hidden_states approach: full CausalLM, all layers kept, then gather."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        pos = torch.as_tensor(positions)
        values = torch.stack([h[0].index_select(0, pos) for h in out.hidden_states], dim=1)
    return np.ascontiguousarray(values.float().numpy())


def _split(site):
    kind, _, layer = site.partition(".")
    return kind, (int(layer) if layer else None)


class _Skafa:
    """skafa's building block on token ids: ``extract_activations``."""

    label = "skafa `extract_activations`"
    reads = ("pre-hook on layer `l` (`resid_pre`), `post_attention_layernorm` output "
             "(`mlp_in`), final norm output (`resid_final`)")

    def __init__(self, model, tokenizer, sites):
        self.model, self.sites = model, sites

    def __call__(self, ids, pos):
        from ..llm import extract_activations

        return extract_activations(self.model, [ids[0].cpu().numpy()], [pos.cpu().numpy()],
                                   self.sites)[0]


class _Bare:
    label = "bare decoder forward, no hooks (`model.model(input_ids)`)"
    reads = "nothing"

    def __init__(self, model, tokenizer, sites):
        self.decoder = model.model

    def __call__(self, ids, pos):
        _bare_forward(self.decoder, ids)


class _NNsight:
    """nnsight 0.8: trace the base decoder, save the rows of every site."""

    label = "nnsight `NNsight(model.model).trace`, `.save()` of the turn rows"
    reads = ("same modules as skafa (`layers[l].input`, `post_attention_layernorm.output`, "
             "`norm.output`)")

    def __init__(self, model, tokenizer, sites):
        from nnsight import NNsight

        self.nn = NNsight(model.model)
        self.sites = sites

    def __call__(self, ids, pos):
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


class _TransformerLens:
    """TransformerLens 4.3: TransformerBridge around a copy of the HF model."""

    label = ("TransformerLens `TransformerBridge.run_with_cache(names_filter=...)`, "
             "rows gathered after")
    reads = ("`blocks.l.hook_resid_pre`, `blocks.l.ln2.hook_out`, `ln_final.hook_out` (same "
             "points; the bridge forces eager attention and runs the LM head)")

    def __init__(self, model, tokenizer, sites):
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
        import torch

        with torch.inference_mode():
            _, cache = self.bridge.run_with_cache(ids, names_filter=self.filter,
                                                  return_type=None)
            rows = [cache[n][0].index_select(0, pos).float().cpu().numpy() for n in self.names]
        return np.stack(rows, axis=1)


class _Mi4afa:
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
        from ag2.extensions.mi4afa import Conversation as PeerConversation
        from ag2.extensions.mi4afa import Turn
        from ag2.extensions.mi4afa.prompt import PromptEncoding

        positions = tuple(int(p) for p in pos.cpu())
        conv = PeerConversation(question="-", ground_truth="-",
                                history=tuple(Turn(name="agent", content="-") for _ in positions))
        enc = PromptEncoding(input_ids=tuple(int(i) for i in ids[0].cpu()),
                             turn_positions=positions)
        values = self.extractor.extract_encoded(conv, enc, sites=self.sites).values
        return np.ascontiguousarray(values.float().numpy().transpose(1, 0, 2))


#: The methods the peers run compares, in its order: ``name -> class`` built as
#: ``cls(model, tokenizer, sites)`` and called as ``method(ids, positions)``.
EXTRACTION_PEERS = {"bare": _Bare, "skafa": _Skafa, "nnsight": _NNsight,
                    "transformer_lens": _TransformerLens, "mi4afa": _Mi4afa}
_PEER_PACKAGES = {"nnsight": "nnsight", "transformer_lens": "transformer_lens",
                  "mi4afa": "ag2.extensions.mi4afa"}


def _available_peers():
    found, missing = [], {}
    with stop_requests():  # Ctrl-C or SIGTERM during an import stops; it is no missing peer
        for name in EXTRACTION_PEERS:
            try:
                if name in _PEER_PACKAGES:
                    module = importlib.import_module(_PEER_PACKAGES[name])
                    version = getattr(module, "__version__", None)
                    if name == "mi4afa":
                        version = importlib.import_module("ag2").__version__
                    found.append((name, version))
                else:
                    found.append((name, None))
            except Exception as exc:  # noqa: BLE001 - report and skip
                raise_if_stop_requested(f"importing {name}", cause=exc)
                missing[name] = f"{type(exc).__name__}: {exc}"
    return found, missing


# -------------------------------------------------------------------------- memory
def _rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_high_water_mark():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _plain_memory_child(method, record_file, model_name):
    """Load the model, reset the RSS high-water mark, run ``method`` on one record."""
    import torch

    from ..llm import TurnActivationTransformer, load_model

    conv = Conversation.from_who_and_when(json.loads(Path(record_file).read_text()))
    t = TurnActivationTransformer(model_name, memory_cache=False).fit([conv])
    model, tok = load_model(model_name, dtype=t.dtype_)  # the transformer's (loaded once)
    enc = t.prompt_.encode(conv, tok)
    ids = torch.as_tensor(enc.input_ids)[None]
    with torch.inference_mode():  # initialise lazy state on a tiny input
        model.model(input_ids=ids[:, :8], use_cache=False)
    baseline = _rss_kib("VmRSS")
    _reset_high_water_mark()
    if method == "bare":
        _bare_forward(model.model, ids)
    elif method == "skafa":
        t.transform([conv])
    elif method == "hidden_states":
        _hidden_states_forward(model, ids, np.asarray(enc.turn_positions))
    return {"method": method, "extra_mib": (_rss_kib("VmHWM") - baseline) / 1024,
            "n_tokens": int(enc.n_tokens)}


def _peer_memory_child(method, record_file, model_name, device, dtype):
    """Load, build one peer, reset the peak, run the record once."""
    import torch

    from ..llm import PromptTemplate, all_sites, load_model

    model, tok = load_model(model_name, device=device, dtype=dtype)
    conv = _record(record_file)
    enc = PromptTemplate().encode(conv, tok)
    ids = torch.as_tensor(enc.input_ids, device=device)[None]
    pos = torch.as_tensor(enc.turn_positions, device=device)
    peer = EXTRACTION_PEERS[method](model, tok, all_sites(model.config.num_hidden_layers))
    peer(ids[:, :8], torch.tensor([7], device=device))  # warm up lazy state
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    baseline = _rss_kib("VmRSS")
    _reset_high_water_mark()
    peer(ids, pos)
    if cuda:
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        extra = (_rss_kib("VmHWM") - baseline) / 1024
    return {"method": method, "extra_mib": extra, "n_tokens": int(enc.n_tokens)}


def _memory_child(spec):
    """Entry point of the fresh process :func:`measure_peak_memory` starts."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    if spec["peers"]:
        out = _peer_memory_child(spec["method"], spec["record"], spec["model"],
                                 spec["device"], spec["dtype"])
    else:
        out = _plain_memory_child(spec["method"], spec["record"], spec["model"])
    Path(spec["out"]).write_text(json.dumps(out))


_CHILD = ("import json, sys; from skafa.benchmarks import _extraction; "
          "_extraction._memory_child(json.loads(sys.argv[1]))")


def measure_peak_memory(method, record_file, *, peers=False, model="smollm2", device="cpu",
                        dtype="float32", threads=None):
    """Peak extra memory (MiB) of one method on one record, in a fresh process.

    The process loads the model, warms the method up, then resets the memory
    high-water mark (CPU: through ``/proc/self/clear_refs``, Linux >= 4.0, so the
    model-loading peak is not counted; CUDA: the allocator's peak) and runs the
    record once: the peak minus the resident memory (allocated memory) before the
    pass. glibc's dynamic mmap threshold is pinned (``MALLOC_MMAP_THRESHOLD_``) so
    freed large buffers go back to the OS and do not hide later growth.

    ``method`` names a :data:`EXTRACTION_PEERS` entry with ``peers=True``; otherwise
    one of ``"bare"``, ``"skafa"`` (``TurnActivationTransformer``) or
    ``"hidden_states"``, on ``model`` in its default dtype on the CPU.

    Returns ``(extra MiB, n_tokens)``; raises ``RuntimeError`` when the process fails.
    """
    import torch

    if not Path(record_file).is_file():
        raise FileNotFoundError(f"memory of {method!r}: no record file {record_file}")

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    with tempfile.TemporaryDirectory(prefix="skafa-memory-") as tmp:
        spec = {"method": method, "record": str(record_file), "peers": bool(peers),
                "model": str(model), "device": str(device), "dtype": str(dtype),
                "threads": threads or torch.get_num_threads(),
                "out": str(Path(tmp) / "out.json")}
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not Path(spec["out"]).exists():
            tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"memory of {method!r} on {record_file}: the process failed "
                               f"({tail[0]})")
        res = json.loads(Path(spec["out"]).read_text())
    return res["extra_mib"], res["n_tokens"]


# ------------------------------------------------------------------------ the plain run
def _loads():
    return os.getloadavg()


def run_extraction_benchmark(settings, *, log=None):
    """(a) bare forward, (b) ``TurnActivationTransformer``, (c) ``output_hidden_states``,
    interleaved per record in rotating order; (d) peak memory per method in fresh
    processes; (e) early stopping after the deepest needed layer; (f) cached
    re-transforms (memory and disk).

    Returns a dict: ``"markdown"`` (the report), ``"total"`` (seconds per method,
    per-record medians summed), ``"memory"`` (MiB per method) and ``"n_records"``.
    """
    import torch

    from ..llm import (
        PromptTemplate,
        TurnActivationTransformer,
        all_sites,
        extract_activations,
        load_model,
    )

    model_name = settings.model
    started = datetime.datetime.now()
    load0 = _loads()
    t0 = time.perf_counter()
    model, tok = load_model(model_name)
    load_s = time.perf_counter() - t0
    prompt = PromptTemplate()
    max_tokens = settings.max_tokens or model.config.max_position_embeddings
    records, skipped = first_records(settings.data, settings.n, max_tokens, tok, prompt)
    convs = [c for c, _ in records]
    encs = [e for _, e in records]
    ids = [torch.as_tensor(e.input_ids)[None] for e in encs]
    positions = [np.asarray(e.turn_positions) for e in encs]
    n_tokens = [int(e.n_tokens) for e in encs]
    _say(log, f"model loaded in {load_s:.1f}s; {len(convs)} records, {sum(n_tokens)} tokens "
              f"(skipped as too long: {skipped})")

    t_plain = TurnActivationTransformer(model_name, memory_cache=False).fit(convs)
    cache_dir = tempfile.mkdtemp(prefix="skafa-bench-cache-")
    t_cached = TurnActivationTransformer(model_name, cache_dir=cache_dir).fit(convs)
    decoder = model.model
    n_layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    n_sites = len(all_sites(n_layers))

    # Warm up every path on the shortest record.
    k = int(np.argmin(n_tokens))
    _bare_forward(decoder, ids[k])
    _hidden_states_forward(model, ids[k], positions[k])
    t_plain.transform([convs[k]])

    def encode_time(i):
        s = time.perf_counter()
        prompt.encode(convs[i], tok)
        return time.perf_counter() - s

    methods = {
        "bare": lambda i: _bare_forward(decoder, ids[i]),
        "skafa": None,  # set per repeat (first repeat fills the cache)
        "hidden_states": lambda i: _hidden_states_forward(model, ids[i], positions[i]),
    }
    times = {m: [[] for _ in convs] for m in methods}
    enc_times = [[] for _ in convs]
    names = list(methods)
    for rep in range(settings.repeats):
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
        _say(log, f"repeat {rep + 1}/{settings.repeats}: " +
             ", ".join(f"{m} {v:.1f}s" for m, v in done.items()))
    if t_cached.run_stats["n_forward_passes"] != len(convs):
        raise RuntimeError("the cached transformer ran more forward passes than records")

    med = {m: [statistics.median(x) for x in times[m]] for m in names}
    total = {m: sum(v) for m, v in med.items()}
    per_record_ratio = {m: statistics.median(a / b for a, b in zip(med[m], med["bare"]))
                        for m in names}
    enc_total = sum(statistics.median(x) for x in enc_times)

    # (e) early stop: the sites of the first half of the layers, 5 records.
    n_half = n_layers // 2
    half = all_sites(n_layers)[: 2 * n_half]
    subset = list(range(min(5, len(convs))))
    es = {True: [[] for _ in subset], False: [[] for _ in subset]}
    for rep in range(settings.repeats):
        for i in subset:
            for flag in ((True, False) if (rep + i) % 2 == 0 else (False, True)):
                s = time.perf_counter()
                extract_activations(model, [encs[i].input_ids], [positions[i]], half,
                                    early_stop=flag)
                es[flag][i].append(time.perf_counter() - s)
    es_total = {f: sum(statistics.median(x) for x in es[f]) for f in es}
    es_bare = sum(med["bare"][i] for i in subset)

    # (f) cached re-transform: memory, then disk from a fresh transformer.
    mem_t, disk_t = [], []
    for _ in range(5):
        s = time.perf_counter()
        t_cached.transform(convs)
        mem_t.append(time.perf_counter() - s)
        fresh = TurnActivationTransformer(model_name, cache_dir=cache_dir,
                                          memory_cache=False).fit(convs)
        s = time.perf_counter()
        fresh.transform(convs)
        disk_t.append(time.perf_counter() - s)
        if fresh.run_stats["n_forward_passes"] != 0:
            raise RuntimeError("a transform from the disk cache ran a forward pass")
    if t_cached.run_stats["n_forward_passes"] != len(convs):
        raise RuntimeError("a transform from the memory cache ran a forward pass")

    # (d) memory, fresh subprocesses, on the longest record.
    longest = int(np.argmax(n_tokens))
    record_file = Path(settings.data) / f"{convs[longest].record_id}.json"
    mem = {}
    for m in names:
        mem[m], _ = measure_peak_memory(m, record_file, model=model_name)
        _say(log, f"memory {m}: +{mem[m]:.0f} MiB")
    t_long = n_tokens[longest]
    n_residual = n_layers + 1
    held_hidden = n_residual * t_long * hidden * 4 / 2**20
    held_logits = t_long * model.config.vocab_size * 4 / 2**20

    load1 = _loads()
    elapsed = time.perf_counter() - t0
    tokens = sum(n_tokens)
    turns = sum(len(c) for c in convs)
    last_half = half[-1]
    model_line = ("SmolLM2-135M-Instruct Q4_1 GGUF dequantised to float32, CPU"
                  if model_name == "smollm2" else f"{model_name}, CPU")
    lines = [
        "# Extraction benchmark",
        "",
        f"- Command: `{_command(settings)}` (run from the repository root)",
        f"- Date: {started:%Y-%m-%d %H:%M}; total run time {elapsed / 60:.1f} min",
        f"- Machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"os.cpu_count()={os.cpu_count()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), attention `{model.config._attn_implementation}`",
        f"- Load average (1/5/15 min) at start {load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}, "
        f"at end {load1[0]:.1f}/{load1[1]:.1f}/{load1[2]:.1f} (the machine is shared; "
        "interleaving keeps the ratios fair, absolute times vary with the load)",
        f"- Model: {model_line}; loaded in {load_s:.1f} s",
        f"- Data: the first {len(convs)} Algorithm-Generated records (numeric order) whose "
        f"prompt fits {max_tokens} tokens; {turns} turns, {tokens} prompt tokens "
        f"(min {min(n_tokens)}, median {int(np.median(n_tokens))}, max {max(n_tokens)}). "
        f"Skipped as too long: {', '.join(f'{r} ({n} tokens)' for r, n in skipped) or 'none'}.",
        f"- Timing: {settings.repeats} repeats, methods interleaved per record in rotating "
        "order; per-record median, summed over records. The first repeat of (b) also "
        "writes the memory and disk cache.",
        "",
        "| method | time (s) | vs (a) total | vs (a) median per record | tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    labels = {
        "bare": "(a) bare decoder forward, no hooks (`model.model(input_ids)`)",
        "skafa": f"(b) skafa `TurnActivationTransformer`, all {n_sites} sites, no cache "
                 "(incl. prompt rendering + tokenization)",
        "hidden_states": "(c) `output_hidden_states=True` on the CausalLM (LM head incl.), "
                         f"{n_residual} residual sites gathered",
    }
    for m in names:
        lines.append(f"| {labels[m]} | {total[m]:.1f} | {total[m] / total['bare']:.3f} | "
                     f"{per_record_ratio[m]:.3f} | {tokens / total[m]:.0f} |")
    lines += [
        f"| (b) minus prompt rendering/tokenization ({enc_total:.2f} s) | "
        f"{total['skafa'] - enc_total:.1f} | "
        f"{(total['skafa'] - enc_total) / total['bare']:.3f} | | |",
        "",
        f"Early stopping (sites `resid_pre.0` .. `{last_half}`, i.e. half the layers, "
        f"{len(subset)} records, `extract_activations`):",
        "",
        "| variant | time (s) | vs (a) on the same records |",
        "|---|---:|---:|",
        f"| stop after `{last_half}` (default) | {es_total[True]:.1f} | "
        f"{es_total[True] / es_bare:.3f} |",
        f"| run all {n_layers} layers | {es_total[False]:.1f} | "
        f"{es_total[False] / es_bare:.3f} |",
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
        f"For scale at {t_long} tokens: all {n_residual} residual hidden states take "
        f"{held_hidden:.0f} MiB and the logits {held_logits:.0f} MiB (float32); skafa "
        f"keeps {len(convs[longest]) * n_sites * hidden * 4 / 2**20:.2f} MiB of activations "
        "for that conversation.",
        "",
    ]
    return {"markdown": "\n".join(lines), "total": total, "memory": mem,
            "n_records": len(convs)}


# --------------------------------------------------------------------------- peers
def run_peers_benchmark(settings, *, log=None):
    """skafa next to a bare forward, nnsight, TransformerLens and mi4afa on the same
    token ids and positions, interleaved record by record; every peer's activations
    compared with skafa's; peak extra memory per method in a fresh process. A peer
    whose package is missing, or that cannot wrap the model, is skipped and named.

    Returns a dict: ``"markdown"``, ``"total"`` (seconds per method), ``"errors"``
    (per-site relative error of each peer against skafa), ``"memory"`` (MiB, None
    when the process failed), ``"missing"`` and ``"failed"``.
    """
    import torch

    from ..llm import PromptTemplate, all_sites, load_model

    device = settings.device
    started = datetime.datetime.now()
    load0 = _loads()
    t0 = time.perf_counter()
    model, tok = load_model(settings.model, device=device, dtype=settings.dtype)
    load_s = time.perf_counter() - t0
    n_layers = model.config.num_hidden_layers
    sites = all_sites(n_layers)
    max_tokens = settings.max_tokens or model.config.max_position_embeddings
    records, skipped = first_records(settings.data, settings.n, max_tokens, tok,
                                     PromptTemplate())
    encs = [e for _, e in records]
    ids = [torch.as_tensor(e.input_ids, device=device)[None] for e in encs]
    pos = [torch.as_tensor(e.turn_positions, device=device) for e in encs]
    n_tokens = [int(e.n_tokens) for e in encs]
    found, missing = _available_peers()
    methods, failed = {}, {}
    with stop_requests():  # a stop while a peer wraps the model is no failed peer
        for name, _ in found:
            try:
                methods[name] = EXTRACTION_PEERS[name](model, tok, sites)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot wrap the model
                raise_if_stop_requested(f"wrapping the model with {name}", cause=exc)
                failed[name] = f"{type(exc).__name__}: {exc}"
    versions = dict(found)
    names = list(methods)
    _say(log, f"{len(encs)} records, {sum(n_tokens)} tokens; methods {names}; "
              f"missing {missing}; failed {failed}")

    for name in names:  # warm up lazy state on a short prefix
        methods[name](ids[0][:, :8], torch.tensor([7], device=device))
    times = {m: [[] for _ in encs] for m in names}
    outs = {m: [None] * len(encs) for m in names}
    for rep in range(settings.repeats):
        for i in range(len(encs)):
            k = (rep + i) % len(names)
            for m in names[k:] + names[:k]:
                _sync(device)
                s = time.perf_counter()
                value = methods[m](ids[i], pos[i])
                _sync(device)
                times[m][i].append(time.perf_counter() - s)
                if rep == 0:
                    outs[m][i] = value
            _say(log, f"  repeat {rep + 1} record {i + 1}/{len(encs)} ({n_tokens[i]} tokens): "
                      + ", ".join(f"{m} {times[m][i][-1]:.1f}s" for m in names))
        _say(log, f"repeat {rep + 1}/{settings.repeats}: " + ", ".join(
            f"{m} {sum(min(x) for x in times[m]):.1f}s" for m in names))
    # Same values? Every peer against skafa, on every record (outputs of the first repeat).
    errors = {name: np.max([_relative_error(outs[name][i], outs["skafa"][i])
                            for i in range(len(encs))], axis=0)
              for name in names if name not in ("bare", "skafa")}
    del outs
    best = {m: [min(x) for x in times[m]] for m in names}
    total = {m: sum(v) for m, v in best.items()}
    ratio = {m: statistics.median(a / b for a, b in zip(best[m], best["bare"])) for m in names}

    # Peak extra memory, one fresh process per method, on the longest record.
    longest = int(np.argmax(n_tokens))
    record_file = Path(settings.data) / f"{records[longest][0].record_id}.json"
    mem = {}
    for m in names:
        try:
            mem[m], _ = measure_peak_memory(m, record_file, peers=True, model=settings.model,
                                            device=device, dtype=settings.dtype)
        except RuntimeError:
            mem[m] = None
        _say(log, f"memory {m}: {mem[m]}")

    load1 = _loads()
    elapsed = time.perf_counter() - t0
    unit = ("allocator peak (`torch.cuda.max_memory_allocated`)" if device.startswith("cuda")
            else "VmHWM minus VmRSS before the pass")
    lines = [
        f"- Command: `OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} "
        f"{_command(settings)}` (repository root); {started:%Y-%m-%d %H:%M}, "
        f"{elapsed / 60:.1f} min",
        f"- Machine: {platform.platform()}, os.cpu_count()={os.cpu_count()}, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads), device {device}, "
        f"dtype {settings.dtype}; load average at start {load0[0]:.1f}, at end {load1[0]:.1f} "
        "(shared machine: the methods are interleaved, so ratios are fairer than absolute "
        "times)",
        f"- Model: {settings.model} ({n_layers} layers, loaded in {load_s:.0f} s), attention "
        f"`{model.config._attn_implementation}`; all {len(sites)} sites at every turn",
        f"- Data: the first {len(encs)} Algorithm-Generated records (numeric order) whose "
        f"prompt fits {max_tokens} tokens: {sum(len(c) for c, _ in records)} turns, "
        f"{sum(n_tokens)} tokens ({min(n_tokens)}..{max(n_tokens)}); skipped: "
        f"{', '.join(f'{r} ({n})' for r, n in skipped) or 'none'}",
        f"- Timing: {settings.repeats} repeats, methods interleaved per record in rotating "
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
        cls = EXTRACTION_PEERS[m]
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
    return {"markdown": "\n".join(lines) + "\n", "total": total, "errors": errors,
            "memory": mem, "missing": missing, "failed": failed}


# -------------------------------------------------------------------------- device
def run_device_benchmark(settings, *, log=None):
    """Batched extraction on a device against a bare forward on the same batches.

    ``TurnActivationTransformer(device=..., dtype=..., batch_size=...)`` (fit and
    transform, rendering included) and a bare decoder forward in the same dtype on the
    same padded batches (:func:`skafa.llm.length_batches`), interleaved over the
    repeats: tokens/s and peak memory (CUDA). On a CPU in a half-precision dtype, a
    bare float32 forward on the same batches is timed in the same repeats. The largest
    relative error of every site against float32 is measured on the first records.

    Returns a dict: ``"markdown"``, ``"seconds"`` (fastest repeat per method),
    ``"errors"`` (per-site relative error against float32) and ``"batches"``.
    """
    import torch

    from ..llm import (
        PromptTemplate,
        TurnActivationTransformer,
        decoder_layout,
        length_batches,
        load_model,
    )

    device = settings.device
    started = datetime.datetime.now()
    cuda = torch.device(device).type == "cuda"
    t0 = time.perf_counter()
    model, tok = load_model(settings.model, device=device, dtype=settings.dtype)
    load_s = time.perf_counter() - t0
    layout = decoder_layout(model)
    max_tokens = settings.max_tokens or model.config.max_position_embeddings
    records, _ = first_records(settings.data, settings.n, max_tokens, tok, PromptTemplate())
    convs = [c for c, _ in records]
    encs = [e for _, e in records]
    lengths = [int(e.n_tokens) for e in encs]
    batch_size = settings.batch_size if settings.batch_size == "auto" \
        else int(settings.batch_size)
    batches = length_batches(lengths, batch_size, layout=layout)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # In another dtype, a bare float32 forward on the same batches and device is timed in
    # the same interleaved repeats: what the half-precision path buys on this machine.
    half = torch.device(device).type == "cpu" and str(settings.dtype) not in (
        "float32", "torch.float32")
    decoders = {"bare": layout.decoder}
    if half:
        decoders["bare float32"] = decoder_layout(
            load_model(settings.model, device=device, dtype="float32")[0]).decoder

    def bare(decoder):
        with torch.inference_mode():
            for batch in batches:
                width = max(lengths[i] for i in batch)
                ids = torch.full((len(batch), width), pad, dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for b, i in enumerate(batch):
                    ids[b, :lengths[i]] = torch.as_tensor(encs[i].input_ids)
                    mask[b, :lengths[i]] = 1
                decoder(input_ids=ids.to(device), attention_mask=mask.to(device),
                        use_cache=False)

    def skafa_run():
        t = TurnActivationTransformer(settings.model, device=device, dtype=settings.dtype,
                                      batch_size=batch_size, memory_cache=False).fit(convs)
        return t, t.transform(convs)

    order = [*decoders, "skafa"]
    results = {name: [] for name in order}
    peaks = {}
    for rep in range(settings.repeats):
        for name in (order if rep % 2 == 0 else order[::-1]):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            s = time.perf_counter()
            out = skafa_run() if name == "skafa" else bare(decoders[name])
            _sync(device)
            results[name].append(time.perf_counter() - s)
            if cuda:
                peaks[name] = max(peaks.get(name, 0),
                                  (torch.cuda.max_memory_allocated() - base) / 2**20)
            if name == "skafa":
                extractor, X = out
        _say(log, f"repeat {rep + 1}: " + ", ".join(f"{name} {results[name][-1]:.2f}s"
                                                    for name in order))
    tokens = sum(lengths)
    seconds = {name: min(v) for name, v in results.items()}
    bare_s, skafa_s = seconds["bare"], seconds["skafa"]

    # Against float32 on the first records (CPU float32 when the device is not the CPU).
    k = min(len(convs), 5)
    ref = TurnActivationTransformer(settings.model, dtype="float32", memory_cache=False,
                                    batch_size=1).fit(convs[:k]).transform(convs[:k])
    err = _relative_error(X.values[: ref.values.shape[0]], ref.values)
    sizes = [len(b) for b in batches]
    lines = [
        f"- Command: `{_command(settings)}`; {started:%Y-%m-%d %H:%M}",
        f"- Machine: {platform.platform()}, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if cuda else "")
        + f", dtype {settings.dtype}, attention `{model.config._attn_implementation}`",
        f"- Model: {settings.model}, {model.config.num_hidden_layers} layers x "
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
    ]
    if half:
        f32 = seconds["bare float32"]
        lines.append(f"| bare forward, same batches, float32 | {f32:.2f} | {tokens / f32:.0f} | "
                     f"{f32 / bare_s:.3f} | nan |")
    lines += [
        "",
        f"{settings.dtype} vs float32 on the first {k} records: largest relative error of a "
        f"turn vector {err.max():.2e} (at `{extractor.sites_[int(np.argmax(err))]}`), median "
        f"over sites {np.median(err):.2e}.",
        "",
    ]
    return {"markdown": "\n".join(lines), "seconds": seconds, "errors": err,
            "batches": batches}
