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
