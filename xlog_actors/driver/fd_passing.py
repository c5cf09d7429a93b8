"""File descriptors between processes of one node: ``SCM_RIGHTS`` over an abstract unix socket.

The CUDA driver shares an IPC-capable memory pool as a POSIX file descriptor, which pickling
cannot carry. The exporting process :meth:`FdServer.offer`\\ s the fd under a key; an importing
process :func:`fetch_fd`\\ es it once (the kernel installs a new descriptor of the same open file
in the receiver). Nothing here knows about CUDA: it is plain POSIX, tested with ordinary fds.

Why ``SCM_RIGHTS`` and not ``pidfd_getfd``: ``pidfd_getfd`` needs ptrace access to the exporter,
which Yama's ``ptrace_scope=1`` (the default of common distributions) grants only to the
exporter's ancestors, while a consumer is usually the exporter's child or sibling; it also needs
Linux 5.6 and knowing the fd's number. A socket both processes reach needs none of that.

Invariants:

* One server per process (:func:`served`), made on first use, at the abstract address
  ``"\\0xlog-fds-<pid>-<random>"``: an abstract name is no file (it goes with its process), and
  the random part keeps a recycled pid, or one of another pid namespace sharing the network
  namespace, from reaching a stranger's server.
* The server answers only peers of its own uid (``SO_PEERCRED``): an fd of a pool grants access
  to all of its memory.
* The server holds a ``dup`` of each offered fd; :meth:`FdServer.withdraw` closes it under the
  lock each answer holds, so a withdrawn (or reused) fd number is never sent.
* :func:`fetch_fd` returns a descriptor the caller owns; on every failure it leaves none open.

Protocol: the client sends the key (UTF-8, at most :data:`MAX_KEY` bytes) and shuts its side
for writing; the server answers ``b"ok"`` with one fd attached, or ``b"no:"`` and the reason,
and closes the connection.

Thread rules: any thread. The server's table is guarded by its lock; one daemon thread accepts
and answers connections one at a time (each answer is bounded by :data:`ANSWER_TIMEOUT_S`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import threading
from typing import Final

from ..errors import DeviceUnavailable, InvalidRequest

__all__ = ["ANSWER_TIMEOUT_S", "MAX_KEY", "FdServer", "fetch_fd", "served"]

#: The longest key, in UTF-8 bytes.
MAX_KEY: Final = 200
#: How long the server gives one client to send its key and take the answer, in seconds.
ANSWER_TIMEOUT_S: Final = 2.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

_server: FdServer | None = None
_server_lock = threading.Lock()


class FdServer:
    """A process's server of file descriptors; see the module docstring.

    Thread rule: any thread.
    """

    def __init__(self) -> None:
        """Bind a fresh abstract address and start the answering thread (use :func:`served`).

        Raises:
            DeviceUnavailable: the socket cannot be made or bound.
        """
        self.pid = os.getpid()
        self.address = f"\0xlog-fds-{self.pid}-{secrets.token_hex(6)}"
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.bind(self.address)
            self._sock.listen(16)
        except OSError as exc:
            raise DeviceUnavailable(f"cannot serve file descriptors at {self.address[1:]!r}: {exc}") from None
        self._thread = threading.Thread(target=self._serve, name=f"xlog-fd-server-{self.pid}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"FdServer({self.address[1:]!r}, {len(self._fds)} offered{', closed' if self._closed else ''})"

    def offer(self, key: str, fd: int) -> None:
        """Serve a duplicate of ``fd`` under ``key`` until :meth:`withdraw` (the caller keeps ``fd``).

        Args:
            key: a name of at most :data:`MAX_KEY` UTF-8 bytes, not offered yet.
            fd: an open descriptor.
        Raises:
            InvalidRequest: a bad or taken key, a closed ``fd``, or a closed server.
        Thread rule: any thread.
        """
        _check_key(key)
        try:
            dup = os.dup(fd)
        except (OSError, TypeError) as exc:
            raise InvalidRequest(f"cannot offer fd {fd!r} under {key!r}: {exc}") from None
        with self._lock:
            if self._closed or key in self._fds:
                os.close(dup)
                raise InvalidRequest(f"cannot offer {key!r}: {'the server is closed' if self._closed else 'taken'}")
            self._fds[key] = dup

    def withdraw(self, key: str) -> bool:
        """Stop serving ``key`` and close the server's duplicate.

        Returns:
            True when ``key`` was offered.
        Thread rule: any thread.
        """
        with self._lock:
            dup = self._fds.pop(key, None)
        if dup is None:
            return False
        os.close(dup)
        return True

    def offered(self) -> list[str]:
        """The keys served now. Thread rule: any thread."""
        with self._lock:
            return sorted(self._fds)

    def close(self) -> None:
        """Withdraw everything and stop the thread. Idempotent. Thread rule: any thread but its own."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
            wake.connect(self.address)  # accept() returns, and the thread sees the flag
        self._thread.join(5.0)
        self._sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                if self._closed:
                    return
                with contextlib.suppress(OSError):  # a client that went away is its own problem
                    self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(ANSWER_TIMEOUT_S)
        _pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        # The key is read before any answer, a refusal's too: a socket closed with unread bytes
        # resets the connection, and the client would read a reset instead of the reason.
        raw = b""
        while len(raw) <= MAX_KEY:  # the client shuts its side after the key: read to the end
            chunk = conn.recv(MAX_KEY + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
        if uid != os.getuid():
            conn.sendall(b"no:a process of another user")
            return
        key = raw.decode("utf-8", "replace")
        with self._lock:
            fd = self._fds.get(key)
            if fd is None:
                conn.sendall(b"no:nothing is offered under this key")
                return
            socket.send_fds(conn, [b"ok"], [fd])


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key or len(key.encode()) > MAX_KEY:
        raise InvalidRequest(f"an fd key is a non-empty str of at most {MAX_KEY} UTF-8 bytes, not {key!r}")


def served() -> FdServer:
    """This process's server, started on first use (and anew in a forked child).

    Raises:
        DeviceUnavailable: it cannot be started.
    Thread rule: any thread.
    """
    global _server
    server = _server
    if server is None or server.pid != os.getpid():
        with _server_lock:
            server = _server
            if server is None or server.pid != os.getpid():
                server = _server = FdServer()
    return server


def fetch_fd(address: str, key: str, timeout_s: float = 5.0) -> int:
    """Ask the server at ``address`` for the fd offered under ``key``.

    Args:
        address: an :attr:`FdServer.address`.
        key: what it was offered under.
        timeout_s: how long connecting and the answer may take together.
    Returns:
        A new descriptor of the same open file; the caller closes it.
    Raises:
        InvalidRequest: a bad key or address.
        DeviceUnavailable: nobody serves ``address`` (its process ended), it refused (``key`` is
            not, or no longer, offered; another user), or it did not answer in ``timeout_s``.
    Thread rule: any thread.
    """
    _check_key(key)
    if not isinstance(address, str) or not address.startswith("\0xlog-fds-"):
        raise InvalidRequest(f"not an fd server address: {address!r}")
    where = f"fd server {address[1:]!r}, key {key!r}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(address)
            sock.sendall(key.encode())
            sock.shutdown(socket.SHUT_WR)
            msg, fds, _flags, _addr = socket.recv_fds(sock, 256, 1)
        except TimeoutError:
            raise DeviceUnavailable(f"{where}: no answer in {timeout_s} s") from None
        except (ConnectionRefusedError, FileNotFoundError):
            raise DeviceUnavailable(f"{where}: nobody serves it (the exporting process ended)") from None
        except OSError as exc:
            raise DeviceUnavailable(f"{where}: {exc}") from None
    if msg == b"ok" and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    reason = msg[3:].decode("utf-8", "replace") if msg.startswith(b"no:") else f"unexpected answer {msg[:40]!r}"
    raise DeviceUnavailable(f"{where}: refused: {reason}")
