"""Numeric command-line options are checked when parsed ("Hostile and odd input, round
four", item 3).

``--seed -1``, ``--seed 2**40`` or ``benchmark --n-resamples 0`` used to reach numpy or
the bootstrap and end in exit 1 ("unexpected ValueError"). Every numeric option now
has a range-checked argparse type: a value outside its documented range is a usage
error (exit 2) naming the option and the range, before any data or model is read.
"""

import contextlib
import io
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skafa.cli import EXIT_USAGE, build_parser, main

COUNT_MAX = 2**31 - 1
#: option -> (low, high) of the accepted integers (the documented ranges)
INT_RANGES = {
    "--offset": (0, COUNT_MAX),
    "--limit": (1, COUNT_MAX),
    "--cv": (2, COUNT_MAX),
    "--max-prompt-tokens": (1, COUNT_MAX),
    "--max-turn-chars": (1, COUNT_MAX),
    "--seed": (0, 2**32 - 1),
    "--top-k": (1, COUNT_MAX),
    "--index": (0, COUNT_MAX),
    "--folds": (2, COUNT_MAX),
    "--n-resamples": (1, 1_000_000),
}
#: command -> (arguments that reach the option, its numeric options)
COMMANDS = {
    "fit": (["fit", "data.json", "--out", "probe"],
            ["--offset", "--limit", "--cv", "--max-prompt-tokens", "--max-turn-chars",
             "--seed", "--C"]),
    "attribute": (["attribute", "probe", "data.json"], ["--offset", "--limit", "--top-k"]),
    "report": (["report", "probe", "data.json"], ["--offset", "--limit", "--top-k",
                                                  "--index"]),
    "benchmark": (["benchmark", "data.json"],
                  ["--offset", "--limit", "--cv", "--max-prompt-tokens", "--max-turn-chars",
                   "--seed", "--C", "--folds", "--n-resamples"]),
}
CASES = [(command, option) for command, (_, options) in COMMANDS.items()
         for option in options]


def _parse(argv):
    """``(namespace, None)`` or ``(None, (exit code, stderr))``: never anything else."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return build_parser().parse_args(argv), None
        except SystemExit as exc:
            return None, (exc.code, err.getvalue())


def _check(command, option, text):
    base, _ = COMMANDS[command]
    ns, failed = _parse(base + [f"{option}={text}"])
    dest = option.lstrip("-").replace("-", "_")
    if failed is not None:
        code, err = failed
        assert code == 2, (option, text, code, err)
        assert f"argument {option}" in err, (option, text, err)
        return None
    value = getattr(ns, dest)
    if option == "--C":
        assert isinstance(value, float) and math.isfinite(value) and value > 0
    else:
        low, high = INT_RANGES[option]
        assert type(value) is int and low <= value <= high, (option, text, value)
    return value


@pytest.mark.parametrize("command, option", CASES)
def test_range_edges(command, option):
    if option == "--C":
        assert _check(command, option, "0.5") == 0.5
        for bad in ("0", "-1", "nan", "inf", "x"):
            assert _check(command, option, bad) is None
        return
    low, high = INT_RANGES[option]
    assert _check(command, option, str(low)) == low
    assert _check(command, option, str(high)) == high
    for bad in (low - 1, high + 1, -(2**40), 2**40, "1.5", "", "ten", "9" * 5000):
        assert _check(command, option, str(bad)) is None, bad


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES),
       text=st.one_of(st.integers().map(str),
                      st.integers(min_value=-3, max_value=2**33).map(str),
                      st.floats(allow_nan=True, allow_infinity=True).map(repr),
                      st.text(max_size=30)))
def test_fuzz_numeric_options(case, text):
    """Any value: parsed inside the documented range, or exit 2 naming the option."""
    command, option = case
    _check(command, option, text)


@pytest.mark.parametrize("argv, option, words", [
    (["benchmark", "data.json", "--seed", "-1"], "--seed", ["0", "4294967295"]),
    (["benchmark", "data.json", "--seed", str(2**40)], "--seed", ["4294967295"]),
    (["fit", "data.json", "--out", "p", "--seed", str(2**40)], "--seed", ["4294967295"]),
    (["benchmark", "data.json", "--n-resamples", "0"], "--n-resamples", ["1", "1000000"]),
    (["benchmark", "data.json", "--n-resamples", "-5"], "--n-resamples", ["1"]),
    (["benchmark", "data.json", "--folds", "1"], "--folds", ["2"]),
    (["fit", "data.json", "--out", "p", "--cv", "0"], "--cv", ["2"]),
    (["attribute", "probe", "data.json", "--top-k", "0"], "--top-k", ["1"]),
    (["report", "probe", "data.json", "--index", "-1"], "--index", ["0"]),
    (["attribute", "probe", "data.json", "--offset", "-2"], "--offset", ["0"]),
    (["attribute", "probe", "data.json", "--limit", "0"], "--limit", ["1"]),
])
def test_main_exits_2_naming_option_and_range(argv, option, words, capsys):
    """The values of the issue: exit 2 before any data is read (not 1, 'unexpected')."""
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"argument {option}" in err and "unexpected" not in err
    for word in words:
        assert word in err
