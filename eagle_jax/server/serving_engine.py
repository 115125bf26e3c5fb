"""What the endpoint handlers share (vLLM's ``OpenAIServing``).

The checks of prompts, token ids and sampling fields; chat rendering; and the two tails
every generation ends in, whatever its endpoint:

* ``collect_response``: once every choice finished, one JSON body of the endpoint's
  choice objects and the usage; 499 when the client left first, 500 when the engine
  failed the request;
* ``stream_response``: server-sent events, one chunk per choice object the endpoint
  yields, then the usage chunk (``stream_options.include_usage``), an error chunk when
  the engine failed the request, and ``[DONE]``.

Either way the choices are aborted if the client goes away.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.protocol import EngineClient
from .async_engine import (
    AsyncEngine,
    Choice,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    abort_all,
    collect,
)
from .protocol import APIError, ChatMessage, SamplingRequest, template_messages
from .serving_models import ServedModel


class OpenAIServing:
    """The engine, its tokenizer and the served model, as every handler sees them."""

    def __init__(self, engine: EngineClient, async_engine: AsyncEngine, model: ServedModel):
        self.engine = engine
        self.async_engine = async_engine
        self.model = model
        self.tokenizer = engine.tokenizer
        self.vocab_size = int(engine.vocab_size)

    # ---------------------------------------------------------------- checks
    def check_token_ids(self, ids: list[int], param: str) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise APIError.bad_request(f"{param} holds token id {t} outside the vocabulary "
                                           f"[0, {self.vocab_size})", param)

    def check_prompt_len(self, n: int, allow_full: bool = False) -> None:
        """A prompt leaves room for one generated token, unless ``allow_full`` (echo only)."""
        if n == 0:
            raise APIError.bad_request("the prompt is empty", "prompt")
        max_model_len = self.model.max_model_len
        limit = max_model_len if allow_full else max_model_len - 1
        if n > limit:
            raise APIError.bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your request has {n} input tokens, and at least one token must be generated "
                f"(the prompt may hold at most {limit} tokens). Please reduce the length of "
                "the prompt.", "prompt")

    def check_sampling(self, req: SamplingRequest) -> None:
        if req.n < 1:
            raise APIError.bad_request(f"n must be >= 1, got {req.n}", "n")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        # Validate the sampling fields once, with a placeholder length.
        req.to_sampling_params(1, None, 0)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                    kwargs: dict | None) -> str:
        """The conversation as prompt text; a template that rejects it is a 400."""
        try:
            return self.tokenizer.apply_chat_template(
                template_messages(messages), add_generation_prompt=add_generation_prompt,
                **(kwargs or {}))
        except (ValueError, TypeError) as e:
            raise APIError.bad_request(str(e), "messages")

    def token_label(self, token_id: int, as_ids: bool) -> str:
        """A token in logprobs: its text, or ``token_id:N`` (vLLM's
        ``return_tokens_as_token_ids``)."""
        return f"token_id:{token_id}" if as_ids else self.tokenizer.token_text(token_id)

    # ------------------------------------------------------------ generation
    async def start_choices(self, request_id: str, choices: list[Choice]) -> None:
        try:
            await self.async_engine.start_choices(request_id, choices)
        except ValueError as e:
            raise APIError.from_value_error(e)
        except (QueueFullError, EngineStoppedError) as e:
            raise APIError(503, str(e))

    def header(self, request_id: str, object_name: str) -> dict:
        """The fields that open a response body or each chunk of a stream."""
        return {"id": request_id, "object": object_name, "created": int(time.time()),
                "model": self.model.name}

    async def collect_response(self, raw_request: Request, header: dict,
                               choices: list[Choice], num_prompt_tokens: int,
                               choice_body: Callable[[Choice], dict]) -> Response:
        try:
            if not await collect(choices, raw_request.is_disconnected):
                return Response(status_code=499)  # nginx's "client closed request"
        except RequestFailedError as e:
            raise APIError(500, str(e))
        return JSONResponse({**header, "choices": [choice_body(c) for c in choices],
                             "usage": _usage(num_prompt_tokens, choices)})

    def stream_response(self, header: dict, choices: list[Choice], num_prompt_tokens: int,
                        include_usage: bool, chunks: AsyncIterator[dict]) -> StreamingResponse:
        return StreamingResponse(
            _sse_events(header, choices, num_prompt_tokens, include_usage, chunks),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _usage(num_prompt_tokens: int, choices: Sequence[Choice]) -> dict:
    """OpenAI ``usage``: prompt tokens counted once per prompt, completion tokens over all
    choices; ``prompt_tokens_details.cached_tokens``, like the prompt tokens, once per
    prompt: the fewest any of its choices had served by the prefix cache (a prompt's
    later choices may reuse the pages its first one computed)."""
    completion = sum(len(c.token_ids) for c in choices)
    cached: dict[int, int] = {}
    for c in choices:
        cached[c.prompt_index] = min(cached.get(c.prompt_index, c.num_cached_tokens),
                                     c.num_cached_tokens)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse_events(header: dict, choices: list[Choice], num_prompt_tokens: int,
                      include_usage: bool, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    # With include_usage every chunk carries "usage": null but the last (OpenAI's rule).
    extra = {"usage": None} if include_usage else {}
    try:
        async with contextlib.aclosing(chunks):
            async for choice in chunks:
                yield _sse({**header, "choices": [choice], **extra})
        if include_usage:
            yield _sse({**header, "choices": [], "usage": _usage(num_prompt_tokens, choices)})
    except RequestFailedError as e:
        yield _sse(APIError(500, str(e)).body())
    finally:
        abort_all(choices)  # however the stream ends, a client disconnect included
    yield "data: [DONE]\n\n"
