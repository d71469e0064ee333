"""uvicorn around the app: listen at once, warm up in the background, shut down on a signal."""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import List

from fastapi import FastAPI

from ..scheduler import Scheduler

_log = logging.getLogger("minikv_compile.serve")


def run_server(app: FastAPI, scheduler: Scheduler, name: str, host: str, port: int) -> int:
    """Serve ``app`` (built by ``create_app`` over ``scheduler``) on ``host:port`` until SIGTERM
    or SIGINT: listen at once, compile and capture every bucket in a background thread, then
    start the scheduler's loop; shut the scheduler down when the server stops. Returns 1 when
    the warm-up failed (the server then stops without ever answering ready), else 0."""
    import uvicorn

    engine = scheduler.engine
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                           timeout_graceful_shutdown=5))
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
            _log.exception("warm-up failed")
            failed.append(e)
            server.should_exit = True

    threading.Thread(target=warm_up, name="minikv-warm-up", daemon=True).start()
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again through the handler
    # found before it: make that an exit through ``finally`` (status 0), not a kill.
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        server.run()
    finally:
        scheduler.shutdown()
    return 1 if failed else 0


def _exit_quietly(signum, frame) -> None:
    raise SystemExit(0)
