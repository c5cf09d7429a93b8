"""File descriptors between processes (``xlog_actors.driver.fd_passing``): what the CUDA pool IPC
passes a pool's fd with, tested with ordinary fds (a pipe, a temporary file) on any host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest

from xlog_actors.driver import fd_passing
from xlog_actors.driver.fd_passing import MAX_KEY, FdServer, fetch_fd, served
from xlog_actors.errors import DeviceUnavailable, InvalidRequest


@pytest.fixture
def server() -> Iterator[FdServer]:
    srv = FdServer()
    yield srv
    srv.close()


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _new_fds(before: set[str], within_s: float = 5.0) -> dict[str, str]:
    """The fds this process opened since ``before`` and still holds, once there are none or
    after ``within_s`` (with what each is): the server's thread closes its end of a connection
    just after the client has read the answer, so an fd of the server may still be open for a
    moment when the client returns. An fd of ``before`` closed meanwhile (by a thread another
    test left running) is no leak and is not counted."""
    deadline = time.monotonic() + within_s
    new = _open_fds() - before
    while new and time.monotonic() < deadline:
        time.sleep(0.01)
        new = _open_fds() - before
    found = {}
    for fd in new:
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # closed as it was read
    return found


def test_a_fetched_fd_is_the_same_open_file(server: FdServer) -> None:
    with tempfile.TemporaryFile() as f:
        f.write(b"xlog pool")
        f.flush()
        server.offer("pool-1", f.fileno())
        got = fetch_fd(server.address, "pool-1")
    try:
        assert os.pread(got, 9, 0) == b"xlog pool", "the file outlives the sender's descriptor"
    finally:
        os.close(got)
    assert server.offered() == ["pool-1"]
    assert server.withdraw("pool-1") and not server.withdraw("pool-1")


def test_another_process_receives_the_fd(server: FdServer) -> None:
    """The child fetches the write end of a pipe and writes into it; the parent reads it."""
    read_end, write_end = os.pipe()
    try:
        server.offer("pipe", write_end)
        os.close(write_end)
        code = (
            "import os, sys\n"
            "from xlog_actors.driver.fd_passing import fetch_fd\n"
            "fd = fetch_fd('\\0' + sys.argv[1], 'pipe')\n"
            "os.write(fd, b'from %d' % os.getpid())\n"
        )
        child = subprocess.run(
            [sys.executable, "-c", code, server.address[1:]], capture_output=True, timeout=60, check=False
        )
        assert child.returncode == 0, child.stderr.decode()
        server.withdraw("pipe")  # the last write end: the read below ends
        assert os.read(read_end, 100).startswith(b"from ")
    finally:
        os.close(read_end)


def test_a_key_not_offered_or_withdrawn_is_refused_and_leaves_no_fd(server: FdServer) -> None:
    before = _open_fds()
    with pytest.raises(DeviceUnavailable, match="nothing is offered"):
        fetch_fd(server.address, "never")
    read_end, write_end = os.pipe()
    server.offer("gone", read_end)
    server.withdraw("gone")
    with pytest.raises(DeviceUnavailable, match="nothing is offered"):
        fetch_fd(server.address, "gone")
    os.close(read_end)
    os.close(write_end)
    assert _new_fds(before) == {}


def test_a_process_of_another_user_is_refused(server: FdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = os.pipe()
    server.offer("mine", read_end)
    uid = os.getuid()
    monkeypatch.setattr(fd_passing.os, "getuid", lambda: uid + 1)  # the server's view of its own uid
    with pytest.raises(DeviceUnavailable, match="another user"):
        fetch_fd(server.address, "mine")
    os.close(read_end)
    os.close(write_end)


def test_a_gone_server_is_device_unavailable() -> None:
    srv = FdServer()
    address = srv.address
    srv.close()
    srv.close()  # idempotent
    with pytest.raises(DeviceUnavailable, match="nobody serves"):
        fetch_fd(address, "any")
    with pytest.raises(InvalidRequest, match="closed"):
        srv.offer("late", 0)


def test_a_server_that_never_answers_times_out() -> None:
    address = f"\0xlog-fds-test-{os.getpid()}-mute"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute:
        mute.bind(address)
        mute.listen(1)  # connects succeed; nobody accepts or answers
        with pytest.raises(DeviceUnavailable, match="no answer"):
            fetch_fd(address, "k", timeout_s=0.2)


@pytest.mark.parametrize("key", ["", "x" * (MAX_KEY + 1), None, 3])
def test_bad_keys_and_addresses_are_refused(server: FdServer, key: object) -> None:
    with pytest.raises(InvalidRequest):
        server.offer(key, 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):
        fetch_fd(server.address, key)  # type: ignore[arg-type]
    assert server.offered() == []


def test_bad_fds_and_taken_keys_change_nothing(server: FdServer) -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    before = _open_fds()
    with pytest.raises(InvalidRequest):
        server.offer("closed", write_end)
    server.offer("once", read_end)
    with pytest.raises(InvalidRequest, match="taken"):
        server.offer("once", read_end)
    assert server.offered() == ["once"]
    server.withdraw("once")
    assert _new_fds(before) == {}
    os.close(read_end)
    with pytest.raises(InvalidRequest, match="not an fd server"):
        fetch_fd("/tmp/xlog-no-such", "k")


def test_the_process_server_is_one() -> None:
    assert served() is served()
    assert served().address.startswith(f"\0xlog-fds-{os.getpid()}-")
