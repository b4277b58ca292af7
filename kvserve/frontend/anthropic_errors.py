"""Anthropic's error shape, for the routes Anthropic's clients call (`/v1/messages...`): what the
server (kvserve/server/anthropic_protocol.py) and the gateway (kvserve/router/app.py) both answer
there instead of OpenAI's shape. A module of its own because the gateway imports nothing of the
server."""

from __future__ import annotations

from typing import Any

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error"), "message": message}}
