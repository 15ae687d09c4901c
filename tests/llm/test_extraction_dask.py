"""Extraction and model selection on a Dask cluster (joblib's Dask backend).

One ``distributed.LocalCluster`` of two single-threaded worker *processes* serves the
whole module. Workers load the tiny model by path (a folder written with
``save_pretrained``), exactly as workers of a real cluster would.
"""

import glob
import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
joblib = pytest.importorskip("joblib")

from sklearn.model_selection import GroupKFold  # noqa: E402

from skafa.conversation import Conversation  # noqa: E402
from skafa.llm import (
    TurnActivationTransformer,  # noqa: E402
    shared_memory_cache,  # noqa: E402
)
from skafa.model_selection import SiteSelector  # noqa: E402
from skafa.probes import GroupedArgmaxLogisticClassifier  # noqa: E402
from skafa.testing import make_conversations, make_tiny_llama, make_tiny_tokenizer  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "benchmark_who_and_when.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(n_layers=2, seed=7).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=40) as cluster, \
            distributed.Client(cluster) as c:
        # Import torch/transformers/skafa on both workers once, outside the timed tests.
        c.run(lambda: __import__("skafa.llm._extraction") and None)
        yield c


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    shared_memory_cache().clear()
    yield
    shared_memory_cache().clear()


def _conversations():
    convs = make_conversations(9, min_turns=1, max_turns=6, seed=11)
    twin = convs[2]  # same content, other ids: must be extracted once
    convs.append(Conversation(twin.turns, task=twin.task, expected_answer=twin.expected_answer,
                              task_id="task-twin", record_id="synthetic/twin"))
    return convs


def _files(cache_dir):
    return sorted(glob.glob(os.path.join(cache_dir, "*", "*.safetensors")))


@pytest.mark.parametrize("batch_size", [1, 3])
def test_dask_extraction_is_bitwise_equal_to_serial(client, model_dir, tmp_path, batch_size):
    convs = _conversations()
    serial = TurnActivationTransformer(model_dir, memory_cache=False, batch_size=batch_size)
    ref = serial.fit(convs).transform(convs)
    cache_dir = str(tmp_path / "cache")
    dist = TurnActivationTransformer(model_dir, memory_cache=False, batch_size=batch_size,
                                     cache_dir=cache_dir, n_jobs=-1).fit(convs)
    with joblib.parallel_config(backend="dask"):
        got = dist.transform(convs)
    np.testing.assert_array_equal(got.values, ref.values)  # bitwise, in input order
    np.testing.assert_array_equal(got.offsets, ref.offsets)
    assert list(got.task_ids) == [c.task_id for c in convs]
    # The twin is extracted once: one pass per distinct conversation (batch_size=1),
    # one file per distinct conversation, written by the workers.
    assert serial.run_stats["n_forward_passes"] == dist.run_stats["n_forward_passes"] == -(-9 // batch_size)
    assert serial.run_stats["n_extracted"] == dist.run_stats["n_extracted"] == 9
    assert len(_files(cache_dir)) == 9
    # A fresh serial transformer reads the workers' files: no forward pass.
    again = TurnActivationTransformer(model_dir, memory_cache=False, batch_size=batch_size,
                                      cache_dir=cache_dir).fit(convs)
    np.testing.assert_array_equal(again.transform(convs).values, ref.values)
    assert again.run_stats["n_forward_passes"] == 0


def _kill_after_first_put(sentinel):
    """Patch this worker: after a cache write, the first worker to take the sentinel dies."""
    import os

    from skafa.llm import _cache as cache

    original = cache.ActivationCache.put

    def put(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.directory is not None:
            try:
                os.remove(sentinel)
            except FileNotFoundError:
                return
            os._exit(1)  # the worker process dies mid-task

    put._original = original
    cache.ActivationCache.put = put


def _unpatch():
    from skafa.llm import _cache as cache

    cache.ActivationCache.put = getattr(cache.ActivationCache.put, "_original",
                                        cache.ActivationCache.put)


def test_killed_worker_loses_nothing_cached_and_the_rerun_completes(client, model_dir,
                                                                     tmp_path):
    convs = make_conversations(12, min_turns=1, max_turns=4, seed=3)
    ref = TurnActivationTransformer(model_dir, memory_cache=False).fit(convs).transform(convs)
    cache_dir = str(tmp_path / "cache")
    sentinel = str(tmp_path / "kill-one-worker")
    Path(sentinel).touch()
    # Two conversations per task, so the worker dies with its task half done.
    t = TurnActivationTransformer(model_dir, memory_cache=False, cache_dir=cache_dir,
                                  batch_size=2, n_jobs=-1).fit(convs)
    client.run(_kill_after_first_put, sentinel)
    try:
        with joblib.parallel_config(backend="dask"):
            got = t.transform(convs)  # Dask retries the dead worker's task elsewhere
    finally:
        client.wait_for_workers(2, timeout=120)  # the nanny restarts the dead worker
        client.run(_unpatch)
    assert not os.path.exists(sentinel)  # a worker did die
    np.testing.assert_allclose(got.values, ref.values, rtol=1e-5, atol=1e-5)
    assert len(_files(cache_dir)) == 12
    # Rerun: everything comes from the cache the workers wrote, nothing is recomputed.
    again = TurnActivationTransformer(model_dir, memory_cache=False,
                                      cache_dir=cache_dir, n_jobs=-1).fit(convs)
    with joblib.parallel_config(backend="dask"):
        X = again.transform(convs)
    assert again.run_stats["n_forward_passes"] == 0 and again.run_stats["disk_hits"] == 12
    np.testing.assert_array_equal(X.values, got.values)


def test_killed_worker_task_is_resumed_from_cache(client, model_dir, tmp_path):
    """The retried task re-reads the disk cache: the dead worker's finished
    conversation is not extracted a second time."""
    from skafa.llm._extraction import _extract_task

    convs = make_conversations(2, min_turns=2, max_turns=3, seed=4)
    t = TurnActivationTransformer(model_dir, memory_cache=False,
                                  cache_dir=str(tmp_path / "c")).fit(convs)
    t.transform(convs[:1])  # conversation 0 is cached, 1 is not
    enc = [t.prompt_.encode(c, t._tokenizer) for c in convs]
    job = {"model": model_dir, "device": "cpu", "dtype": "float32",
           "identity": t.model_identity_, "fingerprint": t.model_fingerprint_,
           "sites": t.sites_, "mean": False, "pad": 0, "batch_size": 1,
           "cache_dir": str(tmp_path / "c")}
    items = [{"key": t._key(c), "input_ids": np.asarray(e.input_ids),
              "positions": np.asarray(e.turn_positions), "starts": None,
              "where": f"conversation {i}", "speakers": list(c.speakers)}
             for i, (c, e) in enumerate(zip(convs, enc))]
    out, n_passes, n_hits = client.submit(_extract_task, job, items, pure=False).result()
    assert (n_passes, n_hits) == (1, 1)
    np.testing.assert_array_equal(np.concatenate(out), t.transform(convs).values)


def test_registered_model_on_process_workers_gives_a_clear_error(client, tmp_path):
    from skafa.llm import register_model, unregister_model

    register_model("test-distributed-registered", make_tiny_llama(n_layers=1),
                   make_tiny_tokenizer(), overwrite=True)
    try:
        convs = make_conversations(3)
        t = TurnActivationTransformer("test-distributed-registered", memory_cache=False,
                                      n_jobs=2).fit(convs)
        with joblib.parallel_config(backend="dask"), \
                pytest.raises(RuntimeError, match="registered .* only in the process"):
            t.transform(convs)
    finally:
        unregister_model("test-distributed-registered")


def test_site_selector_on_dask_equals_serial(client):
    from skafa.testing import make_conversations as mk

    convs = mk(30, min_turns=2, max_turns=6, seed=2)
    from skafa.llm import register_model, unregister_model

    register_model("test-distributed-selector", make_tiny_llama(n_layers=2, seed=1),
                   make_tiny_tokenizer(), overwrite=True)
    try:
        X = TurnActivationTransformer("test-distributed-selector").fit_transform(convs)
    finally:
        unregister_model("test-distributed-selector")
    y = np.array([c.mistake_step for c in convs])
    groups = np.array([c.task_id for c in convs])

    def fit(n_jobs):
        return SiteSelector(GroupedArgmaxLogisticClassifier(C=0.1), cv=GroupKFold(3),
                            n_jobs=n_jobs).fit(X, y, groups=groups)

    serial = fit(None)
    with joblib.parallel_config(backend="dask"):
        dist = fit(-1)
    assert dist.best_site_ == serial.best_site_
    for k in ("mean_test_score", "std_test_score"):
        np.testing.assert_array_equal(dist.cv_results_[k], serial.cv_results_[k])
    np.testing.assert_array_equal(dist.predict(X), serial.predict(X))


def test_nested_benchmark_on_local_cluster_equals_serial(client, tmp_path):
    spec = importlib.util.spec_from_file_location("benchmark_who_and_when_dask", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    common = ["--smoke", "--no-judge", "--cache-dir", str(tmp_path / "cache")]
    serial = bench.main(common + ["--out", str(tmp_path / "serial")])
    dist = bench.main(common + ["--out", str(tmp_path / "dask"),
                                "--scheduler", client.scheduler.address])
    assert dist["predictions"] == serial["predictions"]
    assert dist["summary"] == serial["summary"]
    assert dist["paired"] == serial["paired"]
    assert dist["site_curve_inner"] == serial["site_curve_inner"]
