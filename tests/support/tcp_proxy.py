"""A TCP forwarder that can be taken down and brought back on the same port: a process
restarting behind a fixed address (a gateway's rolling restart), without restarting it.

``down()`` closes the listener and every forwarded connection, so clients see their
calls fail and new connections refused; ``up()`` listens on the same port again.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target`` ("host:port") while up."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._server: socket.socket | None = None
        self._port = 0
        self.up()
        self.address = f"127.0.0.1:{self._port}"

    def up(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            self._server = socket.create_server(("127.0.0.1", self._port))
            self._port = self._server.getsockname()[1]
            threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            server, self._server = self._server, None
            connections, self._connections = self._connections, []
        if server is not None:
            server.close()
        for connection in connections:
            # shutdown, not only close: a thread blocked in recv on it must return.
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    close = down

    def retarget(self, target: str, *, cut: bool = True) -> None:
        """Forward new connections to ``target``, and with ``cut`` cut the forwarded
        ones; the listener stays, so a client reconnecting to the same address lands on
        the new target (a load balancer moving a client to another gateway)."""
        host, port = target.rsplit(":", 1)
        with self._lock:
            self._target = (host, int(port))
            if not cut:
                return
            connections, self._connections = self._connections, []
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # down
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._server is not server:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self._connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        # One side ended: end the other (as a process exiting would).
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


class DelayProxy:
    """Forwards 127.0.0.1:<port> to ``target``, each byte ``delay_s`` later each way: a
    gateway far away (another region), for what a long round trip does to a client."""

    def __init__(self, target: str, delay_s: float) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._delay_s = delay_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                pending: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()
                threading.Thread(target=self._read, args=(source, pending), daemon=True).start()
                threading.Thread(target=self._write, args=(sink, pending), daemon=True).start()

    def _read(self, source: socket.socket, pending: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            pending.put((time.monotonic() + self._delay_s, data))
            if not data:
                return

    @staticmethod
    def _write(sink: socket.socket, pending: queue.SimpleQueue[tuple[float, bytes]]) -> None:
        while True:
            due, data = pending.get()
            time.sleep(max(0.0, due - time.monotonic()))
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()
