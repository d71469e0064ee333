"""The server's door: what a request must carry before any route sees it.

``Guard`` checks, in this order: the ``Host`` header (against the bound address and
``--allowed-hosts``: a web page cannot reach a local server through a DNS name it controls), the
``Origin`` of a browser's request (only ``--allowed-origins``), the API key on ``/v1/*``
(``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open) and, on POST, a
``Content-Type: application/json`` (a cross-origin ``text/plain`` POST needs no preflight, so a
page the user visits could otherwise make the server generate). Each refusal has OpenAI's
error body. It also counts every 4xx answer the server gives (``/metrics``' ``invalid``).
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

from .errors import ApiError

# The addresses a server bound to a loopback address is reached at (a Host header names one).
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServeOptions:
    """What the server enforces at its door (``python -m minikv_compile.serve``'s flags).

    api_key: None (no key) or the key every ``/v1/*`` request must carry as a bearer token.
    allowed_origins: browser origins allowed to call the server (CORS); () refuses every
        request that carries an ``Origin``; ("*",) allows any.
    allowed_hosts: the names a ``Host`` header may carry; None: no check (a server bound to
        every interface and no ``--allowed-hosts``).
    max_body_bytes: a larger body is answered 413 before it is read whole; None: sized from the
        engine's capacity (``parse.body_limit``).
    read_timeout: seconds a client has to send a request's header (from when the connection
        opened or its last answer ended) and, once the header is in, its body.
    parse_special_tokens: chat message content tokenized as HF's ``apply_chat_template`` does,
        special tokens in it parsed (a user message can then forge a turn); False: content
        that holds special-token text is tokenized as text.
    """

    api_key: Optional[str] = None
    allowed_origins: Tuple[str, ...] = ()
    allowed_hosts: Optional[Tuple[str, ...]] = None
    max_body_bytes: Optional[int] = None
    read_timeout: float = 20.0
    parse_special_tokens: bool = False


def allowed_hosts(bound: str, extra: Iterable[str]) -> Optional[Tuple[str, ...]]:
    """The ``Host`` names a server bound to ``bound`` answers: that address (and the loopback
    names when it is a loopback address) plus ``extra`` (``--allowed-hosts``); None (no check)
    for ``*`` in ``extra``, or for a wildcard bind (0.0.0.0, ::) without ``extra``."""
    extra = tuple(h.lower() for h in extra)
    if "*" in extra:
        return None
    try:
        address = ipaddress.ip_address("127.0.0.1" if bound.lower() == "localhost" else bound)
    except ValueError:  # a name: the name itself
        return (bound.lower(),) + extra
    if address.is_unspecified:
        return extra or None
    return tuple(dict.fromkeys(((str(address),) + (_LOOPBACK_NAMES if address.is_loopback
                                                   else ())) + extra))


def _host_name(header: str) -> str:
    """The host of a ``Host`` header without its port (``[::1]:8000`` -> ``::1``)."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0].lower()
    return header.rsplit(":", 1)[0].lower() if header.count(":") == 1 else header.lower()


class Guard:
    """ASGI middleware: refuse what fails the door's checks (see the module), count 4xx."""

    def __init__(self, app, options: ServeOptions, counts: dict):
        self.app, self.options, self.counts = app, options, counts
        self._key = None if options.api_key is None else options.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500 and status not in (429, 499):  # queue full; client gone
                    self.counts["invalid"] += 1
            await send(message)

        refusal = self.refusal(scope)
        if refusal is not None:
            return await refusal.response()(scope, receive, counted)
        await self.app(scope, receive, counted)

    def refusal(self, scope) -> Optional[ApiError]:
        headers = {}
        for name, value in scope["headers"]:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        hosts = self.options.allowed_hosts
        host = headers.get("host")
        if hosts is not None and (host is None or _host_name(host) not in hosts):
            return ApiError(400, f"Host: expected one of {list(hosts)} (the address the server "
                                 f"is bound to and --allowed-hosts), got {host!r}", "Host")
        origins = self.options.allowed_origins
        origin = headers.get("origin")
        if origin is not None and "*" not in origins and origin not in origins:
            return ApiError(403, f"Origin: expected one of {list(origins)} (--allowed-origins), "
                                 f"got {origin!r}", "Origin", code="origin_not_allowed")
        if scope["method"] == "OPTIONS":  # a CORS preflight carries no key and no body
            return None
        if self._key is not None and scope["path"].startswith("/v1/"):
            given = headers.get("authorization")
            token = given[7:].encode() if given and given[:7].lower() == "bearer " else None
            if token is None or not hmac.compare_digest(token, self._key):
                got = ("none" if given is None else "a header without 'Bearer '"
                       if token is None else "a different key")
                return ApiError(401, f"Incorrect API key provided: expected Authorization: "
                                     f"Bearer <the server's --api-key>, got {got}",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return ApiError(415, f"Content-Type: expected application/json, got "
                                     f"{headers.get('content-type')!r}", "Content-Type")
        return None


def install_door(app, options: "ServeOptions", counts: dict) -> None:
    """Put ``app`` (the server's, or the data-parallel front's) behind the door ``options``
    describes: CORS for ``options.allowed_origins``, ``Guard`` before it (it counts 4xx answers
    into ``counts["invalid"]``), and OpenAI's error body for ``ApiError`` and Starlette's own
    HTTP errors (an unknown route, a wrong method)."""
    from fastapi.middleware.cors import CORSMiddleware
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(Guard, options=options, counts=counts)  # the last added runs first

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err: StarletteHTTPException):
        return ApiError(err.status_code, str(err.detail), headers=getattr(err, "headers", None)
                        ).response()
