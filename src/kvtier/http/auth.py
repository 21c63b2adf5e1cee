"""`--api-key`: every endpoint but /health wants `Authorization: Bearer KEY`, as `vllm serve --api-key` does."""

from __future__ import annotations

import hmac

from fastapi import Request

from kvtier.http.error_responses import APIError

OPEN_PATHS = frozenset({"/health"})


def require_api_key(api_key: str | None):
    """A FastAPI dependency refusing (401) requests without the key; None: no key, everything open."""

    async def check(request: Request) -> None:
        if api_key is None or request.url.path in OPEN_PATHS:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                           code="invalid_api_key", kind="authentication_error")

    return check
