"""A stop request (SIGTERM) that arrives while the grafted judge reads a kept KV cache.

The signal's handler raises inside the read; a library (torch, safetensors) can turn
that into another error, which the loop's broad ``except`` used to take for a damaged
file: the good file was deleted, counted as refused, its prompt read again, and the
run went on. Each case runs in a real process that receives a real SIGTERM.
"""

import subprocess
import sys

import pytest

_SCRIPT = r'''
import os, signal, sys, time
from pathlib import Path

import numpy as np

import skafa.baselines._grafted as grafted
from skafa.baselines import GraftedJudge, grafted_split_predictions
from skafa.llm import register_model
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer

work, mode = Path(sys.argv[1]), sys.argv[2]
register_model("skafa-test-stop-llama", make_tiny_llama(max_position_embeddings=4096, seed=3),
               make_tiny_tokenizer(), overwrite=True)
convs = make_conversations(6, min_turns=2, max_turns=5, seed=7)
y = np.array([c.mistake_step for c in convs])
splits = [(np.arange(3), np.arange(3, 6)), (np.arange(3, 6), np.arange(3))]
judge = GraftedJudge("skafa-test-stop-llama", locator_grid=(1,), writer_grid=(1,))
store, kv_dir = work / "graft.json", work / "kv"

# 1. a run interrupted after its head statistics keeps every prompt's KV cache
graft_scores = grafted.GraftedJudge._graft_scores
def interrupted(self, *args, **kwargs):
    raise KeyboardInterrupt("after the statistics")
grafted.GraftedJudge._graft_scores = interrupted
try:
    grafted_split_predictions(judge, convs, y, splits, store=store, kv_dir=kv_dir, keep_kv=True)
except KeyboardInterrupt:
    pass
grafted.GraftedJudge._graft_scores = graft_scores
print("kept", len(list(kv_dir.glob("*/*.safetensors"))), flush=True)

# 2. the resumed run: SIGTERM arrives while a kept file is read, and the reading
#    library turns the handler's exception into an error of its own
def read_then_sigterm(self, i, path, lm, safe_open):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except BaseException as exc:
        raise RuntimeError(f"error while deserializing ({type(exc).__name__})") from None
    raise RuntimeError("error while deserializing")
grafted._KVSpill._check_resumed = read_then_sigterm

def resume():
    grafted_split_predictions(judge, convs, y, splits, store=store, kv_dir=kv_dir, keep_kv=True)
    print("finished", flush=True)

if mode == "benchmark":  # the handler the section 8 runner installs (kill = Ctrl-C)
    from skafa.benchmarks._who_and_when import _sigterm_as_interrupt
    with _sigterm_as_interrupt():
        resume()
elif mode == "application":  # an application's own handler
    def handler(signum, frame):
        raise SystemExit(99)
    signal.signal(signal.SIGTERM, handler)
    resume()
else:  # no handler but Python's default one
    resume()
'''


@pytest.mark.parametrize("mode, status", [("benchmark", 143), ("application", 99),
                                          ("default", 143)])
def test_sigterm_during_a_kept_kv_read_stops_the_run_and_keeps_the_file(tmp_path, mode,
                                                                         status):
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), mode],
                          capture_output=True, text=True, timeout=600)
    kept = sorted(p.name for p in (tmp_path / "kv").glob("*/*.safetensors"))
    assert "kept 6" in done.stdout, done.stderr[-3000:]
    # the process stopped as asked: nothing ran after the signal...
    assert "finished" not in done.stdout, done.stderr[-3000:]
    assert done.returncode == status, done.stderr[-3000:]
    # ...no file was counted as damaged or deleted: the next run resumes from all of them
    assert "refused" not in done.stderr, done.stderr[-3000:]
    assert kept == [f"{i}.safetensors" for i in range(6)]


class _Layer:
    def __init__(self, seed):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(1, 2, 5, 4, generator=g)
        self.values = torch.randn(1, 2, 5, 4, generator=g)


class _Cache:  # what _cache_tensors reads of a transformers DynamicCache
    def __init__(self, seed):
        self.layers = [_Layer(seed), _Layer(seed + 1)]


def test_a_stop_while_this_run_reads_back_a_kept_file_keeps_it(tmp_path, monkeypatch):
    """The file this run kept itself (taken back in the graft pass): a stop during its
    read leaves it for the resumed run; any other failure still removes it."""
    import os
    import signal
    import time

    import numpy as np
    import safetensors.torch

    from skafa.baselines._grafted import _KVSpill
    from skafa.utils.signals import StopRequested, stop_requests

    kv = _KVSpill(tmp_path, resumable="d" * 64, prompts=[np.arange(6)] * 2)
    kv.put(0, _Cache(0))
    kv.put(1, _Cache(2))

    def read_then_sigterm(path, *args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - as a wrapping library does
            raise RuntimeError(f"error while deserializing ({type(exc).__name__})") from None
        raise RuntimeError("error while deserializing")

    monkeypatch.setattr(safetensors.torch, "load_file", read_then_sigterm)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # pytest lives on
    try:
        with stop_requests():
            with pytest.raises(StopRequested, match="stopped by signal 15"):
                kv.take(0, None)
        assert (kv.dir / "0.safetensors").is_file()  # left for the resumed run
        with pytest.raises(RuntimeError, match="deserializing"):  # no stop: removed
            kv.take(1, None)
        assert not (kv.dir / "1.safetensors").exists()
    finally:
        signal.signal(signal.SIGTERM, previous)
