"""A stand-in for a replica server, for the data-parallel front's tests of what a real engine
cannot be made to do on cue: ``python tests/fake_replica.py PORT FLAG_FILE``.

- ``GET /health``: 200 ``{"status": "ok"}``; once ``FLAG_FILE`` exists, 503 ``{"status":
  "failed", "error": "<its text>"}`` (an engine that failed while its process runs).
- ``GET /v1/models``: a body limit of 1 MiB. ``GET /metrics``: one gauge and one counter.
  ``GET /info``: plain text, not JSON.
- ``POST /v1/completions``: a whole answer ``{"replica_port": PORT}``; with ``"stream": true``,
  one event and half of the next (its ``data: {`` and no more), then the connection closes
  without ending the chunked body (a replica that died mid-event).
"""
from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, FLAG = int(sys.argv[1]), sys.argv[2]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            if os.path.exists(FLAG):
                with open(FLAG) as f:
                    self._json(503, {"status": "failed", "error": f.read()})
            else:
                self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "max_body_bytes": 1 << 20}]})
        elif self.path == "/info":  # not JSON: the front must not pass on a plain-text 500
            body = b"ok"
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/metrics":
            body = ("# HELP fake_slots_in_use Slots in use.\n# TYPE fake_slots_in_use gauge\n"
                    "fake_slots_in_use 3\n# HELP fake_requests_total Requests.\n"
                    "# TYPE fake_requests_total counter\nfake_requests_total 7\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not body.get("stream"):
            self._json(200, {"replica_port": PORT})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in (b'data: {"n": 1}\n\n', b'data: {"n'):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.flush()
        self.close_connection = True  # no last chunk: the body is cut off


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
