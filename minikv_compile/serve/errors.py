"""OpenAI's error body, ``{"error": {message, type, param, code}}``, and the checks' 400s."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def checked(param: str, check: Callable, *args, hint: str = "", **kwargs):
    """``check(*args, **kwargs)``, its ``ValueError`` ("param: expected X, got Y") as a 400,
    ``hint`` appended in parentheses."""
    try:
        return check(*args, **kwargs)
    except ValueError as e:
        raise ApiError(400, f"{e} ({hint})" if hint else str(e), param) from None


def bad(param: str, expected: str, got: Any) -> ApiError:
    shown = repr(got) if len(repr(got)) <= 80 else repr(got)[:77] + "..."
    return ApiError(400, f"{param}: expected {expected}, got {shown}", param)
