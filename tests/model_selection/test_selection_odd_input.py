"""Odd training sets for the site selection (issue "Hostile and odd input, round four").

Item 7: conversations that all have one turn (nothing to choose between), or so
few with several turns that some inner training parts have none. Item 8: grouped
cross-validation where some conversations have no task id.
"""

import warnings

import numpy as np
import pytest
from sklearn.exceptions import FitFailedWarning
from sklearn.model_selection import GroupKFold, KFold

from skafa import Conversation, GroupedArgmaxLogisticClassifier, Turn, TurnFeatures
from skafa.model_selection import SiteSelector, outer_splits
from skafa.model_selection._selection import grouped_splits
from skafa.probes import GroupedSoftmaxClassifier


def _features(n_turns, *, task_ids=None, seed=0, n_sites=2):
    rng = np.random.default_rng(seed)
    n_turns = np.asarray(n_turns)
    offsets = np.concatenate([[0], np.cumsum(n_turns)])
    values = rng.normal(size=(offsets[-1], n_sites, 3))
    y = (rng.random(len(n_turns)) * n_turns).astype(np.int64)
    values[offsets[:-1] + y, 1, 0] += 3.0
    X = TurnFeatures(values, offsets, sites=[f"s{j}" for j in range(n_sites)],
                     task_ids=task_ids)
    return X, y


# ------------------------------------------------------- item 7: one turn each
@pytest.mark.parametrize("probe", [GroupedArgmaxLogisticClassifier(),
                                   GroupedSoftmaxClassifier()], ids=lambda p: type(p).__name__)
def test_all_single_turn_conversations_have_nothing_to_choose_between(probe):
    X, y = _features([1] * 12, n_sites=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitFailedWarning)  # refused before any fit
        with pytest.raises(ValueError, match=(
                r"every one of the 12 training conversations has a single turn, so every "
                r"candidate predicts turn 0.*nothing to choose between")) as info:
            SiteSelector(probe, cv=GroupKFold(3)).fit(X, y, groups=np.arange(12))
    assert "no site has a finite mean" not in str(info.value)


def test_folds_whose_training_part_has_only_single_turn_conversations_are_named():
    # conversations 0 and 1 (one task) are the only ones with several turns: the fold
    # that tests them trains on single-turn conversations only.
    n_turns = [4, 3] + [1] * 10
    X, y = _features(n_turns)
    groups = np.array([0, 0] + list(range(1, 11)))
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3))
    with pytest.warns(FitFailedWarning), pytest.raises(ValueError) as info:
        sel.fit(X, y, groups=groups)
    message = str(info.value)
    assert "no site has a finite mean cross-validation score" in message
    fold = next(k for k, (train, _) in enumerate(GroupKFold(3).split(X, y, groups))
                if np.all(X.n_turns[train] == 1))
    assert f"the training part of fold {fold} holds only single-turn conversations" in message
    assert "only 2 of the 12 conversations have more than one turn (conversations 0, 1)" \
        in message
    assert "fewer folds" in message


def test_some_single_turn_conversations_are_fine_when_every_fold_has_others():
    n_turns = [4, 3, 5, 2, 6, 3] + [1] * 6
    X, y = _features(n_turns)
    groups = np.arange(12) % 6  # every fold holds some multi-turn conversations
    sel = SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(
        X, y, groups=groups)
    assert sel.best_site_ in ("s0", "s1")


# ------------------------------------------------ item 8: missing task ids
def test_missing_task_ids_are_named_with_a_count():
    tids = [f"t{i // 2}" for i in range(30)]
    for i in (4, 9, 11, 17, 20, 23, 28):
        tids[i] = None
    X, y = _features(np.full(30, 3), task_ids=tids)
    with pytest.raises(ValueError) as info:
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(X, y)
    message = str(info.value)
    assert "7 of 30 conversations have no task id" in message
    assert "conversations 4, 9, 11, 17, 20 and 2 more" in message
    assert "pass groups=" in message and "task_id" in message and "KFold" in message
    # an ungrouped splitter needs none; explicit groups win over the task ids
    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=KFold(3)).fit(X, y)
    SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(
        X, y, groups=np.arange(30) // 2)


def test_no_task_ids_at_all_still_asks_for_groups():
    X, y = _features(np.full(12, 3))
    with pytest.raises(ValueError, match=r"needs groups: pass groups=.*X carries no task ids"):
        SiteSelector(GroupedArgmaxLogisticClassifier(), cv=GroupKFold(3)).fit(X, y)


def test_missing_task_ids_of_conversations_are_named_by_record_id():
    convs = [Conversation([Turn("a", "x"), Turn("b", "y")], task_id=None if i in (2, 5) else
                          f"t{i}", record_id=f"Algorithm-Generated/{i}") for i in range(8)]
    y = np.zeros(8, dtype=np.int64)
    with pytest.raises(ValueError) as info:
        grouped_splits(GroupKFold(2), convs, y, {}, [c.task_id for c in convs])
    message = str(info.value)
    assert ("2 of 8 conversations have no task id (conversations 2 (record "
            "'Algorithm-Generated/2'), 5 (record 'Algorithm-Generated/5'))") in message


def test_outer_splits_name_missing_task_ids():
    groups = ["a", None, "b", "c", "d", None, "e", "f"]
    y = np.zeros(8, dtype=np.int64)
    with pytest.raises(ValueError, match=r"2 of 8 conversations have no task id "
                                         r"\(conversations 1, 5\)"):
        outer_splits(y, groups, n_folds=2, n_repeats=1)
    with pytest.raises(ValueError, match=r"groups has 7 entries for 8 conversations"):
        outer_splits(y, groups[:7], n_folds=2, n_repeats=1)
    # a mix of int and str ids is two kinds of task, not an error
    assert len(outer_splits(y, ["a", 1, "1", 2, "b", "c", "d", "e"], n_folds=2,
                            n_repeats=1)) == 2


# ------------------------------------- follow-up: a stop request in the site search
class _StoppedInFit(GroupedArgmaxLogisticClassifier):
    """A probe whose fit gets SIGTERM inside a library that turns it into its own error
    (as torch or safetensors may): the site search's broad except sees a RuntimeError."""

    calls = []

    def fit(self, X, y, **params):
        import os
        import signal
        import time

        type(self).calls.append(1)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here (and ends the sleep by raising)
        except BaseException as exc:  # noqa: BLE001 - what such a library does
            raise RuntimeError(f"error in the library ({type(exc).__name__})") from None
        raise RuntimeError("error in the library")


@pytest.fixture
def _sigterm_restored():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _StoppedInFit.calls.clear()
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.usefixtures("_sigterm_restored")
def test_a_stop_request_in_a_fold_stops_the_site_search():
    """SIGTERM during a fold's fit, surfacing as another error, is no failed fit: the
    search stops (StopRequested) instead of warning and going on to the next site."""
    from skafa.exceptions import StopRequested
    from skafa.utils.signals import stop_requests

    X, y = _features(np.full(12, 3), n_sites=3)
    sel = SiteSelector(_StoppedInFit(), cv=KFold(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FitFailedWarning)  # none may be issued
        with stop_requests():
            with pytest.raises(StopRequested, match=r"signal 15 \(SIGTERM\) while fitting "
                                                    r"at site 's0', fold 0") as info:
                sel.fit(X, y)
    assert info.value.code == 143
    assert isinstance(info.value.__cause__, RuntimeError)
    assert len(_StoppedInFit.calls) == 1  # no other site or fold was tried


_STOP_SCRIPT = r"""
import sys, warnings
import numpy as np
from sklearn.exceptions import FitFailedWarning
from sklearn.model_selection import KFold
sys.path.insert(0, sys.argv[1])
from test_selection_odd_input import _StoppedInFit, _features
from skafa.model_selection import SiteSelector

warnings.simplefilter("error", FitFailedWarning)
X, y = _features(np.full(12, 3), n_sites=3)
try:
    SiteSelector(_StoppedInFit(), cv=KFold(3)).fit(X, y)
except KeyboardInterrupt as exc:
    print(type(exc).__name__, exc, flush=True)
    raise
finally:
    print("finally ran after", len(_StoppedInFit.calls), "fit(s)", flush=True)
"""


def test_site_search_records_stop_requests_itself(tmp_path):
    """Without a block of the caller's, SiteSelector.fit records SIGTERM itself: the
    ``finally`` clauses run and the process exits 143, as a shell expects of SIGTERM."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "run.py"
    script.write_text(_STOP_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 143, (done.returncode, done.stderr[-2000:])
    assert "finally ran after 1 fit(s)" in done.stdout
    assert "StopRequested stopped by signal 15 (SIGTERM) while fitting at site 's0'" \
        in done.stdout
