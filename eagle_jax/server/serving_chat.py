"""``POST /v1/chat/completions``: the conversation rendered with the tokenizer's chat
template, ``n`` choices of it, and chat logprobs (``bytes`` included).

``max_completion_tokens`` wins over ``max_tokens``; with neither, a choice may run to the
context limit. A stream opens each choice with a role delta, as OpenAI's does.
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..engine.types import TokenLogprob
from ..sampling import MAX_LOGPROBS
from .async_engine import Choice, fan_out, merge
from .protocol import APIError, ChatCompletionRequest, json_logprob
from .serving_engine import OpenAIServing


class OpenAIServingChat(OpenAIServing):

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        self.model.check(req.model)
        self.check_sampling(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError.bad_request("top_logprobs requires logprobs to be true",
                                           "top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError.bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                           f"{req.top_logprobs}", "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        requested = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        if requested is not None and requested < 1:
            name = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
            raise APIError.bad_request(f"{name} must be >= 1, got {requested}", name)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        self.check_prompt_len(len(ids))
        limit = self.model.max_model_len - len(ids)
        max_tokens = limit if requested is None else min(requested, limit)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = fan_out([ids], req.n,
                          lambda _, i: req.to_sampling_params(max_tokens, num_top, i))
        await self.start_choices(request_id, choices)
        if req.stream:
            return self.stream_response(self.header(request_id, "chat.completion.chunk"),
                                        choices, len(ids), req.include_usage,
                                        self.chunks(req, choices, num_top))
        return await self.collect_response(
            raw_request, self.header(request_id, "chat.completion"), choices, len(ids),
            lambda c: self.choice_body(req, c, num_top))

    def choice_body(self, req: ChatCompletionRequest, c: Choice, num_top: int | None) -> dict:
        lp = None if num_top is None else self.logprobs(c.logprobs, num_top,
                                                         req.return_tokens_as_token_ids)
        return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def logprobs(self, entries: list[TokenLogprob], num_top: int, as_ids: bool) -> dict:
        """The chat ``logprobs`` object: per token its string, logprob, raw bytes and
        ``num_top`` alternatives."""
        content = []
        for e in entries:
            top = []
            for i, (k, v) in enumerate(e.top.items()):
                if i >= num_top:
                    break
                top.append({"token": self.token_label(k, as_ids), "logprob": json_logprob(v),
                            "bytes": list(self.tokenizer.token_bytes(k))})
            content.append({"token": self.token_label(e.token_id, as_ids),
                            "logprob": json_logprob(e.logprob),
                            "bytes": list(self.tokenizer.token_bytes(e.token_id)),
                            "top_logprobs": top})
        return {"content": content}

    async def chunks(self, req: ChatCompletionRequest, choices: list[Choice],
                     num_top: int | None) -> AsyncIterator[dict]:
        """The stream's choice objects: each choice's role delta, then the text deltas."""
        for c in choices:
            yield {"index": c.index, "delta": {"role": "assistant", "content": ""},
                   "logprobs": None, "finish_reason": None}
        async for c, out in merge(choices):
            lp = None
            if num_top is not None and out.new_logprobs is not None:
                lp = self.logprobs(out.new_logprobs, num_top, req.return_tokens_as_token_ids)
            # The finish chunk carries content only when the last output brought text.
            delta = {"content": out.new_text} if (out.new_text or not out.finished) else {}
            yield {"index": c.index, "delta": delta, "logprobs": lp,
                   "finish_reason": out.finish_reason if out.finished else None,
                   "stop_reason": out.stop_reason if out.finished else None}
