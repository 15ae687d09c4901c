"""Length batching (:func:`skafa.llm.length_batches`): longest first, fixed or by memory."""

import pytest

import skafa.llm._batching as batching
from skafa.llm import SequenceTooLarge, decoder_layout, length_batches
from skafa.testing import make_tiny_llama

LENGTHS = [5, 30, 17, 30, 2, 9]


@pytest.fixture(scope="module")
def layout():
    return decoder_layout(make_tiny_llama(n_layers=2, seed=4))


def test_fixed_batches_go_longest_first_ties_by_index():
    assert length_batches(LENGTHS, 1) == [[1], [3], [2], [5], [0], [4]]
    assert length_batches(LENGTHS, 4) == [[1, 3, 2, 5], [0, 4]]
    assert length_batches(LENGTHS, 100) == [[1, 3, 2, 5, 0, 4]]
    assert length_batches([], 3) == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, "big", True, None])
def test_bad_batch_size_is_refused(bad):
    with pytest.raises(ValueError, match="batch_size must be an int >= 1 or 'auto'"):
        length_batches(LENGTHS, bad)


def test_auto_needs_the_layout():
    with pytest.raises(ValueError, match="needs the decoder layout"):
        length_batches(LENGTHS, "auto")


def test_auto_batches_follow_free_memory(layout, monkeypatch):
    per_token, per_pair = batching._activation_bytes(layout)
    assert per_token > 0 and per_pair > 0
    monkeypatch.setattr(batching, "_free_memory", lambda device: 8 * 2**30)
    assert length_batches(LENGTHS, "auto", layout=layout) == [[1, 3, 2, 5, 0, 4]]
    # Room for about two of the longest: they share, the rest go together after.
    w = max(LENGTHS)
    monkeypatch.setattr(batching, "_free_memory",
                        lambda device: 2.2 * (w * per_token + w * w * per_pair) / 0.8)
    batches = length_batches(LENGTHS, "auto", layout=layout)
    assert batches[0] == [1, 3] and sorted(sum(batches, [])) == list(range(len(LENGTHS)))
    assert 1 < len(batches) < len(LENGTHS)
    # A smaller fraction of the same memory: never larger batches.
    fewer = length_batches(LENGTHS, "auto", layout=layout, fraction=0.4)
    assert max(map(len, fewer)) <= max(map(len, batches))


def test_auto_refuses_a_sequence_that_alone_does_not_fit(layout, monkeypatch):
    monkeypatch.setattr(batching, "_free_memory", lambda device: 1000)
    with pytest.raises(SequenceTooLarge, match=r"sequence 1 \(30 tokens\) needs about") as err:
        length_batches(LENGTHS, "auto", layout=layout, device="cpu")
    assert err.value.index == 1 and isinstance(err.value, MemoryError)


def test_free_memory_is_positive_on_the_cpu():
    assert batching._free_memory("cpu") > 0
