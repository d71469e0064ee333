"""uvicorn around the app: listen at once, warm up in the background, shut down on a signal."""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import List, Optional

from fastapi import FastAPI

from ..scheduler import Scheduler

_log = logging.getLogger("minikv_compile.serve")


def run_server(app: FastAPI, scheduler: Scheduler, name: str, host: str, port: int, *,
               read_timeout: float = 20.0, keep_alive: float = 5.0,
               ssl_keyfile: Optional[str] = None, ssl_certfile: Optional[str] = None) -> int:
    """Serve ``app`` (built by ``create_app`` over ``scheduler``) on ``host:port`` until SIGTERM
    or SIGINT: listen at once, compile and capture every bucket in a background thread, then
    start the scheduler's loop; shut the scheduler down when the server stops. Returns 1 when
    the warm-up failed (the server then stops without ever answering ready), else 0.

    read_timeout: a connection that has not sent a whole request header this many seconds after
    it opened (or after its last answer) is closed (the body's own limit is the app's).
    keep_alive: an idle connection is closed this many seconds after its last answer.
    ssl_keyfile, ssl_certfile: serve HTTPS with this key and certificate (PEM files)."""
    engine = scheduler.engine
    server = uvicorn_server(app, host, port, read_timeout=read_timeout, keep_alive=keep_alive,
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
    failed: List[BaseException] = []

    def warm_up() -> None:
        try:
            t0 = time.perf_counter()
            scheduler.warm_up()
            scheduler.start()
            _log.info("ready: %s, every bucket %s prepared and a prompt of max_prompt_len "
                      "prefilled in %.1f s", name, engine.runtime.buckets,
                      time.perf_counter() - t0)
        except BaseException as e:  # noqa: BLE001 -- the server must not say ready
            if server.should_exit:  # stopped while warming up (shutdown ends the warm-up)
                _log.info("stopped before ready: %s", e)
                return
            _log.exception("warm-up failed")
            failed.append(e)
            server.should_exit = True

    threading.Thread(target=warm_up, name="minikv-warm-up", daemon=True).start()
    exit_quietly_on_stop()
    try:
        server.run()
    finally:
        scheduler.shutdown()
    return 1 if failed else 0


def uvicorn_server(app: FastAPI, host: str, port: int, *, read_timeout: float,
                   keep_alive: float, ssl_keyfile: Optional[str] = None,
                   ssl_certfile: Optional[str] = None):
    """The uvicorn server of ``app`` (this server's, or the data-parallel front's): a deadline
    on each request's header (``_protocol``), ``keep_alive``, TLS with the PEM files given, 5 s
    of graceful shutdown."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, timeout_graceful_shutdown=5, timeout_keep_alive=keep_alive,
        http=_protocol(read_timeout), ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile))


def exit_quietly(signum, frame) -> None:
    """A SIGTERM and SIGINT handler: uvicorn re-raises the signal after its graceful shutdown;
    exit through ``finally`` (status 0), not a kill or a KeyboardInterrupt."""
    raise SystemExit(0)


def exit_quietly_on_stop() -> None:
    """uvicorn shuts down gracefully on SIGTERM and SIGINT (Ctrl-C), then raises the signal
    again through the handler found before it: make that ``exit_quietly``."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, exit_quietly)


def _protocol(read_timeout: float):
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's header, from when the
    connection opened or the request's first bytes came (between requests, the keep-alive
    timeout closes an idle connection): uvicorn alone let a connection that sends nothing or
    half a header hold its socket forever. (Over TLS, a client that never completes the handshake is
    closed by asyncio after its 60 s handshake timeout.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_header()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._await_header()  # the first bytes of a request after an answer
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the header is in
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _await_header(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(read_timeout, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return Protocol
