import pytest

from skafa.utils.progress import WorkBar


def test_work_bar_advances_by_each_items_cost(capsys):
    """Items advance the bar by their cost, in any order, and the postfix counts them."""
    with WorkBar([3e9, 1e9], "job") as bar:
        bar.done(1)
        assert bar.bar.n == pytest.approx(1e9) and bar.n_done == 1
        bar.done(0)
        assert bar.bar.n == pytest.approx(bar.bar.total) == pytest.approx(4e9)
    err = capsys.readouterr().err
    assert "job" in err and "FLOP" in err and "2/2 conversations" in err and "100%" in err


def test_work_bar_units_and_items_are_named(capsys):
    with WorkBar([5.0], "scoring", unit="token", items="records") as bar:
        bar.done(0)
    err = capsys.readouterr().err
    assert "token" in err and "1/1 records" in err


def test_work_bar_leaves_out_what_another_process_computes(capsys):
    """An item computed elsewhere leaves the total; done only counts it; it can come back."""
    with WorkBar([3e9, 1e9, 2e9], "job") as bar:
        bar.elsewhere(0)
        bar.elsewhere(0)  # again: nothing changes
        assert bar.bar.total == pytest.approx(3e9)
        bar.done(0)  # read from another process's result: counted, not this one's work
        assert bar.bar.n == 0 and bar.n_done == 1
        bar.elsewhere(2)
        bar.elsewhere(2, False)  # not found after all: this process computes it
        assert bar.bar.total == pytest.approx(3e9)
        bar.done(1)
        bar.done(2)
        assert bar.bar.n == pytest.approx(bar.bar.total) == pytest.approx(3e9)
    assert "3/3 conversations" in capsys.readouterr().err
