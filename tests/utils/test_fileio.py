"""Tests for skafa.utils.fileio: bounded reads of regular files, safetensors."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skafa.utils.fileio import read_regular_file, read_safetensors


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_read_regular_file_refuses_devices_and_fifos(tmp_path):
    link = tmp_path / "entry.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular_file(link)
    with pytest.raises(ValueError, match="not a regular file"):
        read_safetensors(link)
    with pytest.raises(ValueError, match="regular file"):
        read_regular_file(link, follow_symlinks=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular_file(fifo)  # must not block waiting for a writer
    with pytest.raises(ValueError, match="not a regular file"):
        read_regular_file(tmp_path)


def test_read_regular_file_bounds(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"abc")
    assert read_regular_file(f) == b"abc"
    assert read_regular_file(f, max_bytes=3) == b"abc"
    with pytest.raises(ValueError, match="more than the 2 bytes"):
        read_regular_file(f, max_bytes=2)
    ok = tmp_path / "ok"
    ok.symlink_to(f)
    assert read_regular_file(ok) == b"abc"
    with pytest.raises(ValueError, match="symbolic link"):
        read_regular_file(ok, follow_symlinks=False)
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing")


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=300))
def test_read_safetensors_fuzz_only_value_errors(tmp_path, blob):
    f = tmp_path / "f.safetensors"
    f.write_bytes(blob)
    try:
        read_safetensors(f)
    except ValueError:
        pass


def test_read_json_file_refuses_what_json_does_not_allow(tmp_path):
    import os

    import pytest

    from skafa.utils.fileio import read_json_file

    p = tmp_path / "x.json"
    p.write_text('{"a": [1, 2]}')
    assert read_json_file(p, max_bytes=100) == {"a": [1, 2]}
    for text, message in (('{"a": NaN}', "holds NaN"), ('{"a": -Infinity}', "-Infinity"),
                          ('{"a": [1,', "not valid JSON"), ("[" * 100_000, "nested too deeply|not valid")):
        p.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_json_file(p, max_bytes=10**6, where="trace 'x'")
    p.write_bytes(b'"\xff"')
    with pytest.raises(ValueError, match="not UTF-8"):
        read_json_file(p, max_bytes=100)
    p.write_text("[" + "1," * 100 + "1]")
    with pytest.raises(ValueError, match="more than the 50 bytes"):
        read_json_file(p, max_bytes=50)
    link = tmp_path / "zero.json"
    os.symlink("/dev/zero", link)
    with pytest.raises(ValueError, match="not a regular file"):
        read_json_file(link, max_bytes=100)
