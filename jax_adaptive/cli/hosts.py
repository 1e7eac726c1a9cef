"""``--distributed HOST:PORT,N,ID``: every process joins before JAX starts, or one line says why.

jaxlib's coordination client ends a process that cannot join (an address that does not
resolve, a peer that never starts) with a C++ abort and a stack trace, after its timeout,
and a Python callback cannot take its place (jaxlib 0.10: ``missed_heartbeat_callback``
fails with ``std::bad_cast``). So the processes first meet on the coordinator's port over
plain TCP: process 0 listens, each other process connects and says its ID, and once all
are there process 0 says go and closes the port for JAX's own service to bind. Any
failure is a `ValueError` naming the address or the processes missing, within the timeout.

The connections stay open while the job runs (`Peers`): a process that ends without
saying bye (SIGKILL, a lost machine, an error that made it leave) closes them, and every
other process then leaves at once with one line (`leave`), before jaxlib notices (it
aborts a process whose coordinator is gone, with a C++ stack trace) and whether or not
it waits in a collective (NCCL's wait forever).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import threading
import time
from typing import NoReturn

__all__ = ["Peers", "gone_peer", "join", "leave", "lost_line"]

_GO = b"go\n"
_BYE = b"bye\n"
_LEAVING = threading.Lock()
_WATCHING: list[Peers] = []  # this process's watch, while it runs
_GONE_PATIENCE = 0.5  # seconds `gone_peer` waits for the closed connection to show


def leave(status: int, line: str | None) -> NoReturn:
    """Ends this process of the job at once, with ``line`` on stderr: once, whoever calls.

    A process that stops part-way leaves without JAX's exit handler, which would wait at
    the shutdown barrier for peers that wait for this one. Two callers at once (the
    main thread's error and `Peers`' thread seeing a peer gone) print one line: the
    second waits here until the first has ended the process. The line is the last the
    process writes: descriptors 1 and 2 point at the null device before it is written
    (to a copy of 2), so what jaxlib's threads still print (they see the peer gone too)
    goes nowhere. Silencing them only after the line let a jaxlib line through at times
    (1 run in 18, then 1 fresh-clone CI run in about 10 ended on jaxlib's "Terminating
    process" lines).
    """
    _LEAVING.acquire()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        stderr, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.dup2(null, 1)
        if line:
            os.write(stderr, f"{line}\n".encode())
    os._exit(status)


class Peers:
    """The open connections of the meeting, watched while the job runs.

    Process 0 holds one to each other process, each other process one to process 0. A
    connection that closes without ``bye`` means its process ended early: process 0 tells
    the others which one, and each process leaves (`leave`, status 2) naming it.
    `close` says bye: this process ends normally.
    """

    def __init__(self, index: int, connections: dict[int, socket.socket]) -> None:
        self.index, self._connections = index, connections
        self._closing = threading.Event()
        self._said_bye: set[int] = set()
        self._thread = threading.Thread(target=self._watch, name="jax_adaptive-peers", daemon=True)
        self._thread.start()
        _WATCHING[:] = [self]

    def close(self) -> None:
        """Says bye to every connection and stops watching (this process ends normally)."""
        self._closing.set()
        _WATCHING.clear()
        for conn in self._connections.values():
            try:
                conn.sendall(_BYE)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self._thread.join(timeout=2)  # each other's bye; a slower peer's comes after exit
        if not self._thread.is_alive():
            for conn in self._connections.values():
                conn.close()

    def gone(self) -> int | None:
        """The process whose connection closed without bye, or that process 0 named.

        Read now, without waiting; None while every connection is open or said bye.
        """
        for index, conn in self._connections.items():
            if index in self._said_bye:
                continue
            try:
                said = conn.recv(64, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                said = b""
            if said.startswith(b"lost "):
                return int(said.split()[1])
            if not said:
                return index
        return None

    def _watch(self) -> None:
        with selectors.DefaultSelector() as selector:
            for index, conn in self._connections.items():
                conn.settimeout(None)
                selector.register(conn, selectors.EVENT_READ, index)
            while selector.get_map():
                for key, _ in selector.select():
                    gone = self._heard(key.data, key.fileobj)
                    if gone is None:
                        self._said_bye.add(key.data)
                        selector.unregister(key.fileobj)
                    elif gone >= 0 and not self._closing.is_set():
                        self._lost(gone)

    def _heard(self, index: int, conn: socket.socket) -> int | None:
        """Reads ``conn``: None once it said bye, the process gone, or -1 (nothing yet)."""
        try:
            said = conn.recv(64)
        except OSError:
            said = b""
        if said.startswith(b"lost "):  # from process 0: another process is gone
            return int(said.split()[1])
        if _BYE in said or (not said and self._closing.is_set()):
            return None
        return index if not said else -1

    def _lost(self, gone: int) -> NoReturn:
        for index, conn in self._connections.items():
            if index != gone:  # process 0 tells the others which one
                try:
                    conn.sendall(f"lost {gone}\n".encode())
                except OSError:
                    pass
        leave(2, lost_line(gone))


def lost_line(gone: int) -> str:
    """The one line of a process that stops because process ``gone`` ended early."""
    return (
        f"error: a process of the jax.distributed job is gone: process {gone} ended before "
        "the job did (see its own output); this one stops too: resume every process with "
        "--resume"
    )


def gone_peer() -> int | None:
    """The process this one's `Peers` watch sees gone (None: none, or no watch).

    A collective fails as soon as a peer is gone, often before the watch's thread has read
    the closed connection, and at times before that connection's close has even arrived
    (1 fresh-clone run): the caller asks here, which waits up to half a second for it,
    to name the process all the same.

    Examples:
        >>> gone_peer() is None  # no watch in this process
        True
    """
    if not _WATCHING:
        return None
    deadline = time.monotonic() + _GONE_PATIENCE  # its close may land a moment after Gloo's
    while (gone := _WATCHING[0].gone()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return gone


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _resolve(address: str) -> list[tuple]:
    host, port = _split(address)
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(
            f"--distributed: the coordinator's host {host!r} does not resolve ({exc}); "
            "name the host of process 0."
        ) from None


def join(address: str, processes: int, index: int, timeout: float) -> Peers | None:
    """Returns once all ``processes`` have joined at ``address``; else a one-line `ValueError`.

    Process 0 listens on ``address``'s port (every interface, as JAX's service binds
    it); each other process connects to ``address``. Each waits at most ``timeout`` seconds.

    Returns:
        The `Peers` watched from now on (`Peers.close` at a normal end); None for one
        process.

    Examples:
        >>> join("localhost:1", 1, 0, timeout=1)  # one process: nothing to wait for
        >>> join("nohost.invalid:1234", 2, 1, timeout=1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --distributed: the coordinator's host 'nohost.invalid' does not resolve ...
    """
    _resolve(address)
    if processes == 1:
        return None
    deadline = time.monotonic() + timeout
    if index == 0:
        return Peers(0, _gather(address, processes, deadline, timeout))
    return Peers(index, {0: _reach(address, index, deadline, timeout)})


def _gather(
    address: str, processes: int, deadline: float, timeout: float
) -> dict[int, socket.socket]:
    """Process 0: accepts every other process's hello, says go to each: their connections."""
    _, port = _split(address)
    both = socket.has_dualstack_ipv6()  # IPv4 and IPv6, as JAX's service binds [::]:PORT
    family = socket.AF_INET6 if both else socket.AF_INET
    try:
        listener = socket.create_server(("", port), family=family, dualstack_ipv6=both)
    except OSError as exc:
        raise ValueError(
            f"--distributed: process 0 cannot listen on port {port} ({exc.strerror or exc}); "
            "choose a free port."
        ) from None
    peers: dict[int, socket.socket] = {}
    kept = False
    try:
        with listener:
            while len(peers) < processes - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, processes)) - set(peers))
                    raise ValueError(
                        f"--distributed: processes {', '.join(map(str, missing))} of {processes} "
                        f"did not join at {address} within {timeout:g}s; start each with "
                        "--distributed HOST:PORT,N,ID, or raise --distributed-timeout."
                    )
                listener.settimeout(min(left, 1.0))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                try:
                    said = conn.recv(64).decode(errors="replace").strip()
                except OSError:
                    conn.close()
                    continue
                if not said.isdigit() or not 0 < int(said) < processes or int(said) in peers:
                    conn.close()  # not one of ours, or a second process with one ID
                    continue
                peers[int(said)] = conn
            for conn in peers.values():
                conn.sendall(_GO)
            kept = True
            return peers
    finally:
        if not kept:
            for conn in peers.values():
                conn.close()


def _reach(address: str, index: int, deadline: float, timeout: float) -> socket.socket:
    """Another process: connects to process 0 (retrying), says its ID, waits for go."""
    host, port = _split(address)
    met = False  # whether process 0 answered: then another process is missing
    while True:
        left = deadline - time.monotonic()
        if left <= 0 and met:
            raise ValueError(
                f"--distributed: process 0 at {address} did not see every process join "
                f"within {timeout:g}s; start each with --distributed HOST:PORT,N,ID, or "
                "raise --distributed-timeout."
            )
        if left <= 0:
            raise ValueError(
                f"--distributed: process {index} found no process 0 at {address} within "
                f"{timeout:g}s (is it running, with this HOST:PORT?); raise "
                "--distributed-timeout to wait longer."
            )
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 1.0))
        except OSError:
            conn = None  # not listening yet: try again
        if conn is not None:
            met = True
            try:
                conn.sendall(f"{index}\n".encode())
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                if conn.recv(len(_GO)) == _GO:
                    return conn
            except OSError:
                pass  # it turned us away: try again
            conn.close()
        time.sleep(0.2)
