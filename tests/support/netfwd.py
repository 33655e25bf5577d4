"""A TCP port that refuses connections until a delay has passed, then forwards each connection to a target: a
node whose sshd starts after the provider reported it RUNNING (late sshd), for the SSH-readiness tests."""

from __future__ import annotations

import socket
import threading
import time


class LateForwarder:
    """Listens on ``addr``:``port`` (``port`` 0: a free one, known at once as ``.port``) from ``delay_s`` seconds
    after :meth:`start` (at construction with ``start=True``) and forwards to ``target``.  ``running_at`` /
    ``accepting_at``: monotonic times of the start and of the first moment connections are accepted.  Set
    ``.stop`` to end it."""

    def __init__(self, target: tuple[str, int], delay_s: float, *, addr: str = "127.0.0.1", port: int = 0,
                 start: bool = True):
        if port == 0:
            s = socket.socket()
            s.bind((addr, 0))
            port = s.getsockname()[1]
            s.close()
        self.addr, self.port, self.target, self.delay_s = addr, port, target, delay_s
        self.stop = threading.Event()
        self.running_at: float | None = None
        self.accepting_at: float | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        self.running_at = time.monotonic()
        self.thread.start()

    def _serve(self) -> None:
        if self.stop.wait(self.delay_s):
            return
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self.addr, self.port))
        srv.listen(16)
        srv.settimeout(0.2)
        self.accepting_at = time.monotonic()
        while not self.stop.is_set():
            try:
                c, _ = srv.accept()
            except socket.timeout:
                continue
            c.settimeout(None)  # accepted sockets inherit the listener's 0.2 s timeout
            u = socket.create_connection(self.target, timeout=5)
            u.settimeout(None)
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()
        srv.close()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
