"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 503: "server_error", 500: "server_error"}
# Loc entries pydantic adds for union members and validators, which are not field names.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\(-]")


class APIError(Exception):
    """An error answered to the client with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _param(loc: tuple) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.search(part):
            out += f".{part}" if out else part
    return out or None


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    err = exc.errors(include_url=False)[0]
    kind, param = err["type"], _param(tuple(err["loc"]))
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {msg}", code="invalid_json")
    if kind == "model_type" and param is None:
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    if kind == "model_type":
        return APIError(400, f"'{param}' must be a JSON object", param=param,
                        code="invalid_value")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field '{param}': servelm does not support it",
                        param=param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"'{param}' is required", param=param, code="missing_parameter")
    code = "unsupported_parameter" if "not supported" in msg else "invalid_value"
    if param and f"'{param}'" not in msg:
        msg = f"{param}: {msg}"
    return APIError(400, msg, param=param, code=code)


def from_value_error(exc: ValueError, fields: dict[str, str]) -> APIError:
    """A 400 for the engine's or SamplingParams' ValueError, whose text starts with the field.

    fields maps the engine's names to the request's (e.g. 'logprobs' -> 'top_logprobs');
    the key '' is the param for prompt problems.
    """
    msg = str(exc)
    word = msg.split(" ", 1)[0]
    if word in fields:
        param = fields[word]
    elif "max_tokens" in msg:
        param = fields.get("max_tokens", "max_tokens")
    else:
        param = fields.get("")
    return APIError(400, msg, param=param, code="invalid_value")
