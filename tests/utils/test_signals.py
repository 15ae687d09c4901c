"""Tests for skafa.utils.signals: stop requests that a broad ``except`` must not swallow.

Every signal here is real (``os.kill`` of this process). The handler in place before
each test is restored after it.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from skafa.utils.signals import (
    StopRequested,
    raise_if_stop_requested,
    stop_requested,
    stop_requests,
)


@pytest.fixture(autouse=True)
def _restore_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler runs here (and ends the sleep by raising)


def _read_that_a_library_wraps():
    """A read during which SIGTERM arrives, inside a library that turns any exception
    into its own error (as torch or safetensors may)."""
    try:
        _sigterm()
    except BaseException as exc:  # noqa: BLE001 - what such a library does
        raise RuntimeError(f"error while deserializing ({type(exc).__name__})") from None
    raise RuntimeError("error while deserializing")


def test_sigterm_raises_stop_requested_and_is_recorded():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with stop_requests():
        assert stop_requested() is None
        with pytest.raises(StopRequested, match=r"stopped by signal 15 \(SIGTERM\)") as info:
            _sigterm()
        assert stop_requested() == signal.SIGTERM
    assert info.value.signum == signal.SIGTERM and info.value.code == 143
    assert isinstance(info.value, KeyboardInterrupt) and not isinstance(info.value, Exception)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    assert stop_requested() is None  # the record ends with the block


def test_a_stop_that_surfaces_as_another_error_is_not_swallowed():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    damaged = []
    with stop_requests():
        with pytest.raises(StopRequested, match="while reading cache/0.safetensors") as info:
            for path in ["cache/0.safetensors", "cache/1.safetensors"]:
                try:
                    _read_that_a_library_wraps()
                except Exception as exc:  # the loop's broad except
                    raise_if_stop_requested(f"reading {path}", cause=exc)
                    damaged.append(path)
    assert damaged == []
    assert isinstance(info.value.__cause__, RuntimeError)


def test_without_a_stop_request_a_broad_except_goes_on():
    with stop_requests():
        try:
            raise RuntimeError("a damaged file")
        except RuntimeError as exc:
            raise_if_stop_requested("reading it", cause=exc)  # nothing
    raise_if_stop_requested()  # no block: nothing either


def test_the_application_s_own_handler_decides_and_its_exception_is_raised_again():
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        raise SystemExit(99)

    signal.signal(signal.SIGTERM, handler)
    with stop_requests():
        with pytest.raises(SystemExit) as info:
            try:
                _read_that_a_library_wraps()  # the library turned SystemExit into an error
            except Exception as exc:
                raise_if_stop_requested("reading it", cause=exc)
    assert info.value.code == 99 and seen == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is handler


def test_a_handler_that_lets_the_run_go_on_still_makes_a_failed_read_stop():
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    with stop_requests():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert seen == [signal.SIGTERM] and stop_requested() == signal.SIGTERM
        with pytest.raises(StopRequested):
            raise_if_stop_requested("reading it")


def test_ctrl_c_is_recorded_and_stays_a_keyboard_interrupt():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with stop_requests():
        with pytest.raises(KeyboardInterrupt) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert stop_requested() == signal.SIGINT
    assert isinstance(info.value, StopRequested) and info.value.code == 130
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_signal_stays_ignored():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with stop_requests():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop_requested() is None


def test_blocks_nest_and_only_the_outermost_restores():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with stop_requests():
        ours = signal.getsignal(signal.SIGTERM)
        assert ours is not signal.SIG_DFL
        with stop_requests():
            pass
        assert signal.getsignal(signal.SIGTERM) is ours
        with pytest.raises(StopRequested):
            _sigterm()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_outside_the_main_thread_nothing_is_installed():
    got = []

    def work():
        with stop_requests():
            got.append(signal.getsignal(signal.SIGTERM))
            raise_if_stop_requested()

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert got == [signal.SIG_DFL]


def test_an_uncaught_stop_ends_the_process_with_the_signal_s_status():
    code = ("import os, signal, time\n"
            "from skafa.utils.signals import stop_requests\n"
            "with stop_requests():\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
            "    finally:\n"
            "        print('cleaned up', flush=True)\n"
            "print('went on')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 143, done.stderr[-2000:]
    assert done.stdout.split() == ["cleaned", "up"]
