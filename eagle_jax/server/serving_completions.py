"""``POST /v1/completions``: prompts in every OpenAI form, echo, and completions logprobs.

A prompt is a string, a list of token ids, or a list of either (a batch); each prompt gets
``n`` choices. With ``echo`` the prompt text (and, with ``logprobs``, the prompt's own
logprobs, the first token's null) comes before the generated text. ``echo`` with
``max_tokens: 0`` generates nothing: lm-eval's loglikelihood request, answered without
adding anything to the engine.
"""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from ..engine.types import TokenLogprob
from ..sampling import MAX_LOGPROBS
from .async_engine import Choice, fan_out, merge
from .protocol import APIError, CompletionRequest, json_logprob
from .serving_engine import OpenAIServing

# The echoed prompt of each prompt index: its text, and its logprob entries with logprobs.
EchoedPrompts = list[tuple[str, list[TokenLogprob | None] | None]]


class OpenAIServingCompletion(OpenAIServing):

    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        self.model.check(req.model)
        self.check_sampling(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError.bad_request(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens is not None and req.max_tokens < 1 and not echo_only:
            raise APIError.bad_request(
                f"max_tokens must be >= 1 (0 only with echo), got {req.max_tokens}",
                "max_tokens")
        prompts = self.prompts(req)
        for ids, _ in prompts:
            self.check_prompt_len(len(ids), allow_full=echo_only)

        def params(prompt_index: int, sample_index: int):
            if echo_only:
                return None
            limit = self.model.max_model_len - len(prompts[prompt_index][0])
            max_tokens = limit if req.max_tokens is None else min(req.max_tokens, limit)
            return req.to_sampling_params(max_tokens, req.logprobs, sample_index)

        request_id = f"cmpl-{uuid.uuid4().hex}"
        choices = fan_out([ids for ids, _ in prompts], req.n, params)
        echo: EchoedPrompts = []
        if req.echo:
            echo = [await self.echo(req, ids, text) for ids, text in prompts]
        if echo_only:
            for c in choices:  # nothing to generate: done at their length limit
                c.finish_reason = "length"
        else:
            await self.start_choices(request_id, choices)
        header = self.header(request_id, "text_completion")
        num_prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if req.stream:
            return self.stream_response(header, choices, num_prompt_tokens, req.include_usage,
                                        self.chunks(req, choices, echo))
        return await self.collect_response(raw_request, header, choices, num_prompt_tokens,
                                           lambda c: self.choice_body(req, c, echo))

    def prompts(self, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        """Each prompt as (token ids, its text when it came as text)."""
        p = req.prompt
        if isinstance(p, str):
            items: list = [p]
        elif len(p) == 0:
            raise APIError.bad_request("the prompt is empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        out = []
        for item in items:
            if isinstance(item, str):
                if item == "":
                    raise APIError.bad_request("the prompt is empty", "prompt")
                ids = self.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
                out.append((ids, item))
            else:
                if len(item) == 0:
                    raise APIError.bad_request("the prompt is empty", "prompt")
                self.check_token_ids(item, "prompt")
                out.append((list(item), None))
        return out

    async def echo(self, req: CompletionRequest, ids: list[int],
                   text: str | None) -> tuple[str, list[TokenLogprob | None] | None]:
        """A prompt as echoed: its text, and with logprobs its logprob entries."""
        text = text if text is not None else self.tokenizer.decode(ids)
        if req.logprobs is None:
            return text, None
        try:
            entries = await self.async_engine.run_in_engine(
                self.engine.prompt_logprobs, ids, req.logprobs)
        except ValueError as e:
            raise APIError.bad_request(str(e), "prompt")
        return text, entries

    def logprobs(self, req: CompletionRequest, entries: list[TokenLogprob | None],
                 token_ids: list[int], text_offset: int = 0) -> dict:
        """The completions ``logprobs`` object: per token its string, logprob, text offset
        and ``req.logprobs`` alternatives (plus the sampled token, as vLLM adds it); a
        prompt's first token has none (null)."""
        as_ids = req.return_tokens_as_token_ids
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, e in zip(token_ids, entries):
            s = self.token_label(tid, as_ids)
            tokens.append(s)
            offsets.append(text_offset)
            text_offset += len(s)
            if e is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(json_logprob(e.logprob))
            top = {}
            for i, (k, v) in enumerate(e.top.items()):
                if i >= req.logprobs:
                    break
                top.setdefault(self.token_label(k, as_ids), json_logprob(v))
            top.setdefault(s, json_logprob(e.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def choice_body(self, req: CompletionRequest, c: Choice, echo: EchoedPrompts) -> dict:
        text, entries, token_ids = c.text, c.logprobs, c.token_ids
        if req.echo:
            echo_text, echo_entries = echo[c.prompt_index]
            text = echo_text + text
            if echo_entries is not None:
                entries, token_ids = echo_entries + entries, c.prompt_ids + token_ids
        lp = None if req.logprobs is None else self.logprobs(req, entries, token_ids)
        return {"index": c.index, "text": text, "logprobs": lp,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    async def chunks(self, req: CompletionRequest, choices: list[Choice],
                     echo: EchoedPrompts) -> AsyncIterator[dict]:
        """The stream's choice objects: each echoed prompt first, then the deltas."""
        text_offsets = {c.index: 0 for c in choices}  # where each choice's next token starts
        for c in choices if req.echo else ():
            text, entries = echo[c.prompt_index]
            lp = None if entries is None else self.logprobs(req, entries, c.prompt_ids)
            yield {"index": c.index, "text": text, "logprobs": lp,
                   "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if lp is not None:
                text_offsets[c.index] += sum(map(len, lp["tokens"]))
        async for c, out in merge(choices):
            lp = None
            if req.logprobs is not None and out.new_logprobs is not None:
                lp = self.logprobs(req, out.new_logprobs, out.new_token_ids,
                                   text_offsets[c.index])
                text_offsets[c.index] += sum(map(len, lp["tokens"]))
            yield {"index": c.index, "text": out.new_text, "logprobs": lp,
                   "finish_reason": out.finish_reason if out.finished else None,
                   "stop_reason": out.stop_reason if out.finished else None}
