"""OpenAI-compatible HTTP server (FastAPI), following vLLM's and SGLang's servers.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``.

Errors use the OpenAI / vLLM body ``{"object": "error", "error": {"message", "type",
"param", "code"}}``: 400 for invalid JSON, bad fields and prompts the engine cannot take,
401 without the API key, 404 for an unknown model or route, 413 for a body over
``max_body_bytes``, 500 when the engine fails mid-request, 503 when every slot is busy
and the waiting queue is full.

Choices are indexed prompt-major (prompt ``p``, sample ``i`` -> ``p * n + i``), as vLLM
does. Each choice is one engine request; a client that disconnects aborts all of its
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import time
import uuid
from typing import Any, AsyncIterator, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.types import RequestOutput, TokenLogprob
from ..sampling import MAX_LOGPROBS, SamplingParams
from .async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from .metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("eagle_jax.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_COMPLETION_MAX_TOKENS = 16
_NEG_INF_LOGPROB = -9999.0  # what vLLM reports for -inf

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _usage(num_prompt_tokens: int, choices) -> dict:
    """OpenAI ``usage``: prompt tokens once, completion tokens summed over the choices."""
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


# ---------------------------------------------------------------------- errors

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: Any = None,
                 err_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = status if code is None else code
        self.err_type = err_type or _ERROR_TYPES.get(status, "APIError")

    def body(self) -> dict:
        return {
            "object": "error",
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            },
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _param_of(message: str) -> str | None:
    m = re.match(r"^([a-z_]+) ", message)
    return m.group(1) if m else None


# -------------------------------------------------------------- request models
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:N"


Prompt = Union[StrictStr, list[StrictInt], list[list[StrictInt]], list[StrictStr]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


def _validation_message(err: ValidationError) -> tuple[str, str | None]:
    e = err.errors()[0]
    loc = [str(x) for x in e.get("loc", ())]
    field = loc[0] if loc else None
    path = ".".join(loc)
    return f"{path}: {e.get('msg')} (got {e.get('input')!r:.200})", field


# ------------------------------------------------------------------ the server
class _Choice:
    """One engine request of an HTTP request (a prompt's i-th sample)."""

    def __init__(self, index: int, prompt_ids: list[int], prompt_text: str | None,
                 params: SamplingParams):
        self.index = index
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.params = params
        self.stream: RequestStream | None = None
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None


class OpenAIServer:
    def __init__(self, engine: Any, *, served_model_name: str | None = None,
                 api_key: str | None = None, max_queue_len: int = 1024,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_interval: float = 10.0,
                 model_path: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name or engine.model_name
        self.model_path = model_path or getattr(getattr(engine, "config", None), "model", None)
        self.max_model_len = int(engine.max_model_len)
        self.vocab_size = int(engine.vocab_size)
        self.api_key = api_key or None
        self.max_body_bytes = int(max_body_bytes)
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_name)
        self.async_engine = AsyncEngine(
            engine, self.metrics, log_interval=log_interval, max_queue_len=max_queue_len
        )

    # ------------------------------------------------------------- helpers
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model",
                           code="model_not_found")

    async def read_json(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise _bad("invalid Content-Length header")
            if n > self.max_body_bytes:
                raise APIError(413, f"request body of {n} bytes exceeds the limit of "
                                    f"{self.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise APIError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _bad(f"Invalid JSON in request body: {e}")
        if not isinstance(data, dict):
            raise _bad(f"request body must be a JSON object, got {type(data).__name__}")
        return data

    @staticmethod
    def parse(model_cls, data: dict):
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            msg, field = _validation_message(e)
            raise _bad(msg, field)

    def _ts(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.tokenizer.token_text(token_id)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise _bad(f"{param} holds token id {t} outside the vocabulary "
                           f"[0, {self.vocab_size})", param)

    def check_prompt_len(self, n: int, allow_full: bool = False) -> None:
        if n == 0:
            raise _bad("the prompt is empty", "prompt")
        limit = self.max_model_len if allow_full else self.max_model_len - 1
        if n > limit:
            raise _bad(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {n} input tokens, and at least one token must be generated "
                f"(the prompt may hold at most {limit} tokens). Please reduce the length of "
                "the prompt.", "prompt")

    def chat_messages(self, messages: list[ChatMessage]) -> list[dict]:
        out = []
        for i, m in enumerate(messages):
            d = m.model_dump(exclude_none=False)
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") == "text" and isinstance(part.get("text"), str):
                        texts.append(part["text"])
                    else:
                        raise _bad(f"messages[{i}].content: only text parts are supported, "
                                   f"got type {part.get('type')!r}", "messages")
                content = "\n".join(texts)
            d["content"] = "" if content is None else content
            out.append(d)
        return out

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    kwargs: dict | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                self.chat_messages(messages), add_generation_prompt=add_generation_prompt,
                **(kwargs or {}))
        except APIError:
            raise
        except (ValueError, TypeError) as e:
            raise _bad(str(e), "messages")

    def sampling_params(self, req: _SamplingRequest, max_tokens: int, logprobs: int | None,
                        sample_index: int) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=None if req.seed is None else req.seed + sample_index,
                max_tokens=max_tokens,
                stop=req.stop,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except ValueError as e:
            raise _bad(str(e), _param_of(str(e)))

    def validate_common(self, req: _SamplingRequest) -> None:
        if req.n < 1:
            raise _bad(f"n must be >= 1, got {req.n}", "n")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        # Validate the sampling fields once, with a placeholder length.
        self.sampling_params(req, 1, None, 0)

    # ------------------------------------------------------ engine plumbing
    async def start_choices(self, request_id: str, choices: list[_Choice]) -> None:
        """Adds every choice to the engine; on any failure aborts those already added."""
        if self.async_engine.queue_is_full(len(choices)):
            raise APIError(503, "the server is overloaded: all slots are busy and the waiting "
                                "queue is full; retry later")
        try:
            for c in choices:
                c.stream = await self.async_engine.add_request(
                    f"{request_id}-{c.index}", c.prompt_ids, c.params)
        except BaseException as e:
            for c in choices:
                if c.stream is not None:
                    c.stream.abort()
            if isinstance(e, ValueError):
                raise _bad(str(e), _param_of(str(e)))
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e))
            if isinstance(e, EngineStoppedError):
                raise APIError(503, str(e))
            raise

    @staticmethod
    def abort_all(choices: list[_Choice]) -> None:
        for c in choices:
            if c.stream is not None:
                c.stream.abort()

    async def collect(self, request: Request, choices: list[_Choice]) -> bool:
        """Runs every choice to completion; aborts them all and returns False if the client
        disconnects."""

        async def consume(c: _Choice):
            async for out in c.stream:
                self._absorb(c, out)

        tasks = [asyncio.ensure_future(consume(c)) for c in choices if c.stream is not None]

        async def watch():
            while True:
                await asyncio.sleep(0.1)
                if await request.is_disconnected():
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            gathered = asyncio.gather(*tasks)
            done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if gathered not in done:  # the client went away
                self.abort_all(choices)
                gathered.cancel()
                with contextlib.suppress(BaseException):
                    await gathered
                return False
            gathered.result()
            return True
        except BaseException:
            self.abort_all(choices)
            for t in tasks:
                t.cancel()
            raise
        finally:
            watcher.cancel()

    @staticmethod
    def _absorb(c: _Choice, out: RequestOutput) -> None:
        c.token_ids.extend(out.new_token_ids)
        c.text += out.new_text
        if out.new_logprobs:
            c.logprobs.extend(out.new_logprobs)
        if out.finished:
            c.finish_reason = out.finish_reason
            c.stop_reason = out.stop_reason

    # ------------------------------------------------------ logprob formats
    @staticmethod
    def _lp(x: float) -> float:
        if x is None or math.isnan(x):
            return _NEG_INF_LOGPROB
        return max(float(x), _NEG_INF_LOGPROB)

    def completion_logprobs(self, entries: list[TokenLogprob | None], token_ids: list[int],
                            num_top: int, text_offset: int = 0, as_ids: bool = False) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, e in zip(token_ids, entries):
            s = self._ts(tid, as_ids)
            tokens.append(s)
            offsets.append(text_offset)
            text_offset += len(s)
            if e is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(self._lp(e.logprob))
            top = {}
            for i, (k, v) in enumerate(e.top.items()):
                if i >= num_top:
                    break
                top.setdefault(self._ts(k, as_ids), self._lp(v))
            top.setdefault(s, self._lp(e.logprob))  # vLLM includes the sampled token
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def chat_logprobs(self, entries: list[TokenLogprob], num_top: int,
                      as_ids: bool = False) -> dict:
        content = []
        for e in entries:
            s = self._ts(e.token_id, as_ids)
            top = []
            for i, (k, v) in enumerate(e.top.items()):
                if i >= num_top:
                    break
                ks = self._ts(k, as_ids)
                top.append({"token": ks, "logprob": self._lp(v),
                            "bytes": list(self.tokenizer.token_bytes(k))})
            content.append({"token": s, "logprob": self._lp(e.logprob),
                            "bytes": list(self.tokenizer.token_bytes(e.token_id)),
                            "top_logprobs": top})
        return {"content": content}

    # -------------------------------------------------------- completions
    def completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif len(p) == 0:
            raise _bad("the prompt is empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        out = []
        for item in items:
            if isinstance(item, str):
                if item == "":
                    raise _bad("the prompt is empty", "prompt")
                ids = self.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                out.append((ids, item))
            else:
                if len(item) == 0:
                    raise _bad("the prompt is empty", "prompt")
                self.check_token_ids(item, "prompt")
                out.append((list(item), None))
        return out

    async def completions(self, request: Request) -> Response:
        req = self.parse(CompletionRequest, await self.read_json(request))
        self.check_model(req.model)
        self.validate_common(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise _bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens is not None and req.max_tokens < 1 and not echo_only:
            raise _bad(f"max_tokens must be >= 1 (0 only with echo), got {req.max_tokens}",
                       "max_tokens")
        if "max_tokens" in req.model_fields_set:
            requested = req.max_tokens  # None: up to the context limit
        else:
            requested = DEFAULT_COMPLETION_MAX_TOKENS
        prompts = self.completion_prompts(req)
        for ids, _ in prompts:
            self.check_prompt_len(len(ids), allow_full=echo_only)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices: list[_Choice] = []
        for p_idx, (ids, text) in enumerate(prompts):
            limit = self.max_model_len - len(ids)
            max_tokens = limit if requested is None else min(requested, limit)
            for i in range(req.n):
                params = (self.sampling_params(req, max(max_tokens, 1), req.logprobs, i)
                          if not echo_only else None)
                choices.append(_Choice(p_idx * req.n + i, ids, text, params))

        # Prompt text and logprobs for echo.
        echo: dict[int, tuple[str, dict | None]] = {}
        if req.echo:
            for p_idx, (ids, text) in enumerate(prompts):
                prompt_text = text if text is not None else self.tokenizer.decode(ids)
                lp = None
                if req.logprobs is not None:
                    try:
                        entries = await self.async_engine.run_in_engine(
                            self.engine.prompt_logprobs, ids, req.logprobs)
                    except ValueError as e:
                        raise _bad(str(e), "prompt")
                    lp = self.completion_logprobs(entries, ids, req.logprobs,
                                                  as_ids=req.return_tokens_as_token_ids)
                echo[p_idx] = (prompt_text, lp)

        num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if echo_only:
            body = self._completion_echo_only(request_id, created, choices, echo, req,
                                              num_prompt_tokens)
            if not req.stream:
                return JSONResponse(body)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def echo_stream():
                for ch in body["choices"]:
                    yield self._sse({**{k: body[k] for k in ("id", "object", "created", "model")},
                                     "choices": [ch]})
                if include_usage:
                    yield self._sse({**{k: body[k] for k in ("id", "object", "created", "model")},
                                     "choices": [], "usage": body["usage"]})
                yield "data: [DONE]\n\n"

            return StreamingResponse(echo_stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await self.start_choices(request_id, choices)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = self._completion_stream(request_id, created, choices, echo, req,
                                          num_prompt_tokens, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            if not await self.collect(request, choices):
                return Response(status_code=499)  # nginx's "client closed request"
        except RequestFailedError as e:
            raise APIError(500, str(e))
        out_choices = []
        for c in choices:
            p_idx = c.index // req.n
            text = c.text
            lp = None
            if req.logprobs is not None:
                lp = self.completion_logprobs(c.logprobs, c.token_ids, req.logprobs,
                                              as_ids=req.return_tokens_as_token_ids)
            if req.echo:
                e_text, e_lp = echo[p_idx]
                text = e_text + text
                if lp is not None and e_lp is not None:
                    lp = self._concat_completion_logprobs(e_lp, lp)
            out_choices.append({"index": c.index, "text": text, "logprobs": lp,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created,
            "model": self.model_name, "choices": out_choices,
            "usage": _usage(num_prompt_tokens, choices),
        })

    @staticmethod
    def _concat_completion_logprobs(a: dict, b: dict) -> dict:
        shift = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
        return {
            "tokens": a["tokens"] + b["tokens"],
            "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]],
        }

    def _completion_echo_only(self, request_id, created, choices, echo, req, num_prompt_tokens):
        out = []
        for c in choices:
            text, lp = echo[c.index // req.n]
            out.append({"index": c.index, "text": text, "logprobs": lp,
                        "finish_reason": "length", "stop_reason": None})
        return {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": out, "usage": _usage(num_prompt_tokens, [])}

    async def _merged(self, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, Any]]:
        """Yields (choice, RequestOutput) from all choices as they arrive."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice):
            try:
                async for out in c.stream:
                    await queue.put((c, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((c, e))
                return
            await queue.put((c, None))

        tasks = [asyncio.ensure_future(pump(c)) for c in choices]
        remaining = len(tasks)
        try:
            while remaining:
                c, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield c, item
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def _sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _sse_stream(self, base: dict, choices: list[_Choice], num_prompt_tokens: int,
                          include_usage: bool, chunks: AsyncIterator[dict]):
        """The SSE framing both streams share: one chunk per choice dict from ``chunks``,
        then the usage chunk (``stream_options.include_usage``), an error chunk when the
        engine failed the request, and ``[DONE]``. The choices are aborted however the
        stream ends (a client disconnect included)."""
        extra = {"usage": None} if include_usage else {}
        try:
            async with contextlib.aclosing(chunks):
                async for choice in chunks:
                    yield self._sse({**base, "choices": [choice], **extra})
            if include_usage:
                yield self._sse({**base, "choices": [],
                                 "usage": _usage(num_prompt_tokens, choices)})
        except RequestFailedError as e:
            yield self._sse(APIError(500, str(e)).body())
        finally:
            self.abort_all(choices)
        yield "data: [DONE]\n\n"

    def _completion_stream(self, request_id, created, choices, echo, req, num_prompt_tokens,
                           include_usage):
        base = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name}

        async def chunks():
            offsets = {c.index: 0 for c in choices}
            if req.echo:
                for c in choices:
                    text, lp = echo[c.index // req.n]
                    yield {"index": c.index, "text": text, "logprobs": lp,
                           "finish_reason": None, "stop_reason": None}
                    if lp and lp["tokens"]:
                        offsets[c.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            async for c, out in self._merged(choices):
                self._absorb(c, out)
                lp = None
                if req.logprobs is not None and out.new_logprobs is not None:
                    lp = self.completion_logprobs(out.new_logprobs, out.new_token_ids,
                                                  req.logprobs, offsets[c.index],
                                                  as_ids=req.return_tokens_as_token_ids)
                    if lp["tokens"]:
                        offsets[c.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                if not out.new_token_ids and not out.new_text and not out.finished:
                    continue
                yield {"index": c.index, "text": out.new_text, "logprobs": lp,
                       "finish_reason": out.finish_reason if out.finished else None,
                       "stop_reason": out.stop_reason if out.finished else None}

        return self._sse_stream(base, choices, num_prompt_tokens, include_usage, chunks())

    # ---------------------------------------------------------------- chat
    async def chat_completions(self, request: Request) -> Response:
        req = self.parse(ChatCompletionRequest, await self.read_json(request))
        self.check_model(req.model)
        self.validate_common(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise _bad(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                           f"{req.top_logprobs}", "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if requested is not None and requested < 1:
            name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise _bad(f"{name} must be >= 1, got {requested}", name)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        self.check_prompt_len(len(ids))
        limit = self.max_model_len - len(ids)
        max_tokens = limit if requested is None else min(requested, limit)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices = [_Choice(i, ids, text, self.sampling_params(req, max_tokens, num_top, i))
                   for i in range(req.n)]
        await self.start_choices(request_id, choices)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = self._chat_stream(request_id, created, choices, num_top, len(ids),
                                    include_usage, req.return_tokens_as_token_ids)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            if not await self.collect(request, choices):
                return Response(status_code=499)  # nginx's "client closed request"
        except RequestFailedError as e:
            raise APIError(500, str(e))
        out = []
        for c in choices:
            out.append({
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": (self.chat_logprobs(c.logprobs, num_top, req.return_tokens_as_token_ids)
                             if num_top is not None else None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            })
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created,
            "model": self.model_name, "choices": out, "usage": _usage(len(ids), choices),
        })

    def _chat_stream(self, request_id, created, choices, num_top, num_prompt_tokens,
                     include_usage, as_ids=False):
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}

        async def chunks():
            for c in choices:
                yield {"index": c.index, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None}
            async for c, out in self._merged(choices):
                self._absorb(c, out)
                if not out.new_token_ids and not out.new_text and not out.finished:
                    continue
                lp = None
                if num_top is not None and out.new_logprobs is not None:
                    lp = self.chat_logprobs(out.new_logprobs, num_top, as_ids)
                delta = {"content": out.new_text} if (out.new_text or not out.finished) else {}
                yield {"index": c.index, "delta": delta, "logprobs": lp,
                       "finish_reason": out.finish_reason if out.finished else None,
                       "stop_reason": out.stop_reason if out.finished else None}

        return self._sse_stream(base, choices, num_prompt_tokens, include_usage, chunks())

    # ------------------------------------------------------------ other routes
    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "eagle_jax", "root": self.model_path or self.model_name,
            "parent": None, "max_model_len": self.max_model_len, "permission": [],
        }]}

    async def tokenize(self, request: Request) -> dict:
        req = self.parse(TokenizeRequest, await self.read_json(request))
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise _bad("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            text = self.render_chat(req.messages, req.add_generation_prompt,
                                    req.chat_template_kwargs)
            add_special = False if req.add_special_tokens is None else req.add_special_tokens
        else:
            text = req.prompt
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = self.tokenizer.encode(text, add_special_tokens=add_special)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": None}

    async def detokenize(self, request: Request) -> dict:
        req = self.parse(DetokenizeRequest, await self.read_json(request))
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        t = self.tokenizer
        template = t.chat_template
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "vocab_size": self.vocab_size,
            "model_max_length": self.max_model_len,
            "bos_token": t.bos_token, "bos_token_id": t.bos_token_id,
            "eos_token": t.eos_token, "eos_token_id": t.eos_token_id,
            "eos_token_ids": list(t.eos_token_ids),
            "pad_token": t.pad_token, "pad_token_id": t.pad_token_id,
            "add_bos_token": t.add_bos_token,
            "chat_template": template,
        }


# ------------------------------------------------------------ ASGI middleware
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
            resp = APIError(401, "Unauthorized: a valid API key is required "
                                 "(Authorization: Bearer <key>)").response()
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(engine: Any, *, served_model_name: str | None = None, api_key: str | None = None,
               max_queue_len: int = 1024, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               log_interval: float = 10.0, model_path: str | None = None) -> FastAPI:
    """Builds the FastAPI app around an ``Engine``; the engine thread runs while it lives."""
    server = OpenAIServer(engine, served_model_name=served_model_name, api_key=api_key,
                          max_queue_len=max_queue_len, max_body_bytes=max_body_bytes,
                          log_interval=log_interval, model_path=model_path)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.async_engine.start()
        try:
            yield
        finally:
            server.async_engine.shutdown()

    app = FastAPI(title="eagle_jax OpenAI-compatible server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health():
        if not server.async_engine.is_running:
            raise APIError(503, "the engine loop is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await server.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return server.tokenizer_info()

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app
