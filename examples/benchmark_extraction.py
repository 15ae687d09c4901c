"""Benchmark skafa's activation extraction against a bare forward pass.

Runs SmolLM2-135M-Instruct (float32, CPU) on Who&When Algorithm-Generated records
and measures, in one run, interleaving the methods record by record and repeating:

(a) a bare decoder forward pass on the same token ids, no hooks
    (``model.model(input_ids)``: embeddings, layers, final norm; no LM head);
(b) :class:`skafa.extraction.TurnActivationTransformer` reading all 61 sites,
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

Usage::

    python examples/benchmark_extraction.py [--data ../shared/data/who_and_when]
        [--n 20] [--repeats 3] [--output docs/extraction-benchmark.md]

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
    from skafa.extraction import TurnActivationTransformer

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
    parser.add_argument("--_memory-child", dest="memory_child", default=None,
                        help=argparse.SUPPRESS)
    parser.add_argument("--_record", dest="record", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import numpy as np
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        return _memory_child(args.memory_child, args.record, args.data)

    from skafa.extraction import TurnActivationTransformer, extract_activations
    from skafa.sites import all_sites

    started = datetime.datetime.now()
    load0 = os.getloadavg()
    from skafa.models import load_model
    from skafa.prompt import PromptTemplate

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
