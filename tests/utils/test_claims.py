"""Claim files: who holds one, and waiting for a running claimant (skafa.utils.claims)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from skafa.utils import claims


@pytest.fixture
def other():
    """Another running process of this host."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _write(path, **who):
    path.write_text(json.dumps(who))
    return path


def test_this_process_claim_names_it():
    who = json.loads(claims.claim_text())
    assert who["pid"] == os.getpid() and who["host"] == socket.gethostname()
    assert who["start"] == claims.process_start(os.getpid())


def test_a_live_claimant_of_this_host_holds_its_claim(tmp_path, other):
    start = claims.process_start(other.pid)
    if start is None:
        pytest.skip("no /proc/<pid>/stat on this system")
    host = socket.gethostname()
    path = tmp_path / "x.claim"
    assert claims.claim_holder_alive(_write(path, pid=other.pid, host=host, start=start))
    assert claims.claim_holder_alive(_write(path, pid=other.pid, host=host))  # no start: pid
    assert claims.claim_holder_alive(_write(path, pid=other.pid, host=host, start="x"))
    # a pid reused by another process (another start time) is not the claimant
    assert not claims.claim_holder_alive(_write(path, pid=other.pid, host=host,
                                                start=start + 1))
    assert not claims.claim_holder_alive(_write(path, pid=other.pid, host="elsewhere",
                                                start=start))
    assert not claims.claim_holder_alive(_write(path, pid=os.getpid(), host=host))  # mine
    for bad in ("{}", "[1]", '{"pid": true}', '{"pid": 1.5}', '{"pid": -3}', "x" * 5000, ""):
        path.write_text(bad)
        assert not claims.claim_holder_alive(path), bad
    path.unlink()
    assert not claims.claim_holder_alive(path)  # gone
    os.mkfifo(path)  # would block a plain open()
    assert not claims.claim_holder_alive(path)
    path.unlink()
    live = _write(tmp_path / "live.claim", pid=other.pid, host=host, start=start)
    path.symlink_to(live)  # a live claim, linked
    assert not claims.claim_holder_alive(path)


def test_a_claim_of_an_ended_process_is_not_held(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    path = _write(tmp_path / "x.claim", pid=proc.pid, host=socket.gethostname())
    assert not claims.claim_holder_alive(path)
    assert claims.process_start(proc.pid) is None


def test_wait_while_claimed_waits_for_the_item_or_the_claimant(tmp_path, other, monkeypatch):
    monkeypatch.setattr(claims, "POLL_SECONDS", 0.02)
    path = _write(tmp_path / "x.claim", pid=other.pid, host=socket.gethostname(),
                  start=claims.process_start(other.pid))
    assert claims.wait_while_claimed(path, lambda: True) is False  # done: no wait
    flag = []
    timer = threading.Timer(0.3, flag.append, [1])
    timer.start()
    t = time.monotonic()
    assert claims.wait_while_claimed(path, lambda: bool(flag)) is True
    assert time.monotonic() - t >= 0.25 and flag
    killer = threading.Timer(0.3, other.kill)  # the claimant dies: the wait ends
    killer.start()
    assert claims.wait_while_claimed(path, lambda: False) is True
    killer.join()
    stale = _write(tmp_path / "y.claim", pid=os.getpid(), host=socket.gethostname())
    assert claims.wait_while_claimed(stale, lambda: False) is False


def test_create_claim_is_exclusive(tmp_path):
    path = tmp_path / "x.claim"
    assert claims.create_claim(path) is True
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert claims.create_claim(path) is False  # held
    assert claims.create_claim(tmp_path / "missing" / "x.claim") is None  # not writable
