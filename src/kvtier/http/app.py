"""The FastAPI application: OpenAI-compatible routes over a `Backend`."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvtier.http.auth import require_api_key
from kvtier.http.backend import Backend
from kvtier.http.completion import CHAT, COMPLETION, respond
from kvtier.http.error_responses import APIError, install_error_handlers
from kvtier.http.schemas import ChatCompletionRequest, CompletionRequest


def create_app(backend: Backend) -> FastAPI:
    """The app; its shutdown (uvicorn's lifespan end, after in-flight requests) closes `backend`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        backend.close()  # fails what is still unfinished, closes the engine and its flash file

    app = FastAPI(title="kvtier", lifespan=lifespan, dependencies=[Depends(require_api_key(backend.settings.api_key))])
    install_error_handlers(app)
    created = int(time.time())
    model_name = backend.settings.model_name

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "kvtier", "max_model_len": backend.llm.context_length}]}

    @app.get("/metrics")
    async def metrics():
        return Response(backend.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        return await respond(backend, COMPLETION, backend.text_ids(body.prompt), body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        return await respond(backend, CHAT, backend.chat_ids(messages), body, request)

    return app
