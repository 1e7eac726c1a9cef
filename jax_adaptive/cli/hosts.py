"""``--distributed HOST:PORT,N,ID``: every process joins before JAX starts, or one line says why.

jaxlib's coordination client ends a process that cannot join (an address that does not
resolve, a peer that never starts) with a C++ abort and a stack trace, after its timeout,
and a Python callback cannot take its place (jaxlib 0.10: ``missed_heartbeat_callback``
fails with ``std::bad_cast``). So the processes first meet on the coordinator's port over
plain TCP: process 0 listens, each other process connects and says its ID, and once all
are there process 0 says go and closes the port for JAX's own service to bind. Any
failure is a `ValueError` naming the address or the processes missing, within the timeout.
"""

from __future__ import annotations

import socket
import time

__all__ = ["join"]

_GO = b"go\n"


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


def join(address: str, processes: int, index: int, timeout: float) -> None:
    """Returns once all ``processes`` have joined at ``address``; else a one-line `ValueError`.

    Process 0 listens on ``address``'s port (every interface, as JAX's service binds
    it); each other process connects to ``address``. Each waits at most ``timeout`` seconds.

    Examples:
        >>> join("localhost:1", 1, 0, timeout=1)  # one process: nothing to wait for
        >>> join("nohost.invalid:1234", 2, 1, timeout=1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --distributed: the coordinator's host 'nohost.invalid' does not resolve ...
    """
    _resolve(address)
    if processes == 1:
        return
    deadline = time.monotonic() + timeout
    if index == 0:
        _gather(address, processes, deadline, timeout)
    else:
        _reach(address, index, deadline, timeout)


def _gather(address: str, processes: int, deadline: float, timeout: float) -> None:
    """Process 0: accepts every other process's hello, then says go to each."""
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
            for conn in peers.values():  # each closes first: the port is free at once
                conn.settimeout(max(deadline - time.monotonic(), 1.0))
                try:
                    conn.recv(1)
                except OSError:
                    pass
    finally:
        for conn in peers.values():
            conn.close()


def _reach(address: str, index: int, deadline: float, timeout: float) -> None:
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
            with socket.create_connection((host, port), timeout=min(left, 1.0)) as conn:
                met = True
                conn.sendall(f"{index}\n".encode())
                conn.settimeout(max(deadline - time.monotonic(), 0.1))
                if conn.recv(len(_GO)) == _GO:
                    return
        except OSError:
            pass  # not listening yet, or it turned us away: try again
        time.sleep(0.2)
