"""A TCP proxy in front of a real redis-server that can lose one reply: the network fault where
a command ran on the server and its answer never reached the client."""

from __future__ import annotations

import socket
import threading


class ReplyDroppingProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._pattern: bytes | None = None
        self.dropped = 0
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_reply_to(self, pattern: bytes) -> None:
        """Lose the reply to the next request that contains ``pattern`` (once)."""
        self._pattern = pattern

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._open += [client, upstream]
            doomed = threading.Event()  # this connection's next reply is lost
            threading.Thread(target=self._pump, args=(client, upstream, doomed, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, doomed, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, doomed: threading.Event, replies: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if replies and doomed.is_set():
                    # The server ran the command and answered; the client never hears it.
                    self.dropped += 1
                    break
                if not replies and self._pattern is not None and self._pattern in data:
                    self._pattern = None
                    doomed.set()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def retarget(self, port: int) -> None:
        """Send new connections to another server and cut the open ones: a failover behind one
        address (a Sentinel-managed name, a virtual IP), as a client sees it."""
        self.target_port = port
        for s in self._open:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._open = []

    def close(self) -> None:
        self._listen.close()
        for s in self._open:
            try:
                s.close()
            except OSError:
                pass
