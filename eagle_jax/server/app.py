"""OpenAI-compatible HTTP server (FastAPI), following vLLM's and SGLang's servers.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``.

Errors use the OpenAI / vLLM body ``{"object": "error", "error": {"message", "type",
"param", "code"}}``: 400 for invalid JSON, bad fields and prompts the engine cannot take,
401 without the API key, 404 for an unknown model or route, 413 for a body over
``max_body_bytes``, 500 when the engine fails mid-request, 503 when every slot is busy
and the waiting queue is full.

This module holds the app, its routes and what stands in front of every route (the API
key, the body-size limit, the error handlers). The wire schema is ``protocol``; each
endpoint's handling and formatting is a ``serving_*`` module; the engine thread and the
choices of a request are ``async_engine``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.protocol import EngineClient
from ..engine.types import CompileProgress
from .async_engine import AsyncEngine
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from .serving_chat import OpenAIServingChat
from .serving_completions import OpenAIServingCompletion
from .serving_models import ServedModel
from .serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("eagle_jax.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _read_json(request: Request, max_body_bytes: int) -> dict:
    """The request body as a JSON object; 413 past ``max_body_bytes``, whether the
    Content-Length says so up front or a chunked body grows past it."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            n = int(length)
        except ValueError:
            raise APIError.bad_request("invalid Content-Length header")
        if n > max_body_bytes:
            raise APIError(413, f"request body of {n} bytes exceeds the limit of "
                                f"{max_body_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_body_bytes} bytes")
        chunks.append(chunk)
    try:
        data = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError.bad_request(f"Invalid JSON in request body: {e}")
    if not isinstance(data, dict):
        raise APIError.bad_request(
            f"request body must be a JSON object, got {type(data).__name__}")
    return data


class _APIKeyMiddleware:
    """Requires ``Authorization: Bearer KEY`` on every route except ``/health``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/health" or \
                scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                auth = v
                break
        if not hmac.compare_digest(auth, self.expected):
            resp = _error_response(APIError(401, "Unauthorized: a valid API key is required "
                                                 "(Authorization: Bearer <key>)"))
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def readiness(progress: CompileProgress) -> dict:
    """``/health``'s body: the server answers (it listens once the engine is ready);
    "ready-compiling" while executables still compile in the background (requests are
    served, some at less than full speed), then "ready-complete"."""
    return {"status": "ready-complete" if progress.complete else "ready-compiling",
            "executables_compiled": progress.compiled,
            "executables_total": progress.total}


def create_app(engine: EngineClient, *, served_model_name: str | None = None,
               api_key: str | None = None, max_queue_len: int = 1024,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_interval: float = 10.0,
               model_path: str | None = None) -> FastAPI:
    """Builds the FastAPI app around an engine; the engine thread runs while it lives."""
    model = ServedModel(served_model_name or engine.model_name,
                        model_path or engine.config.model, engine.max_model_len)
    metrics = ServerMetrics(model.name)
    async_engine = AsyncEngine(engine, metrics, log_interval=log_interval,
                               max_queue_len=max_queue_len)
    completion = OpenAIServingCompletion(engine, async_engine, model)
    chat = OpenAIServingChat(engine, async_engine, model)
    tokenization = OpenAIServingTokenization(engine, async_engine, model)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="eagle_jax OpenAI-compatible server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)

    async def parse(request: Request, model_cls):
        return parse_request(model_cls, await _read_json(request, max_body_bytes))

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(
            APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            raise APIError(503, "the engine loop is not running")
        return readiness(engine.compile_progress)

    @app.get("/metrics")
    async def metrics_text():
        metrics.update_compile_progress(engine.compile_progress)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return model.model_list()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion.create_completion(await parse(request, CompletionRequest),
                                                  request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.create_chat_completion(await parse(request, ChatCompletionRequest),
                                                 request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return tokenization.tokenize(await parse(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return tokenization.detokenize(await parse(request, DetokenizeRequest))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenization.tokenizer_info()

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app
