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
