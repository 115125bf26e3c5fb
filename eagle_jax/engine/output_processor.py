"""Committed tokens into request outputs: stop conditions, detokenization, stop strings,
logprobs. It reports a finish on the request (``finished``, ``finish_reason``) and frees
nothing: the scheduler releases a finished request's slot and pages.
"""

from __future__ import annotations

from eagle_jax.engine.request import Request
from eagle_jax.grammar import GrammarCompiler
from eagle_jax.engine.types import RequestOutput, TokenLogprob
from eagle_jax.sampling import SamplingParams


def token_logprobs(tokens, logprob, top_ids, top_logprobs, num_top: int
                   ) -> list[TokenLogprob]:
    """One TokenLogprob per token: its logprob and its ``num_top`` best alternatives.
    tokens, logprob: [n]; top_ids, top_logprobs: [n, >= num_top] (host arrays)."""
    return [TokenLogprob(int(token), float(lp), {
        int(i): float(v) for i, v in zip(ids[:num_top], lps[:num_top])})
            for token, lp, ids, lps in zip(tokens, logprob, top_ids, top_logprobs)]


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int, eos_ids: set[int], *,
                 vocab_size: int | None = None, structured_output_error: str | None = None):
        """``vocab_size``: the tokens a grammar's masks cover (None: the tokenizer's);
        ``structured_output_error``: why the engine cannot serve structured output
        (None: it can)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.vocab_size = vocab_size
        self.structured_output_error = structured_output_error
        self._grammars: GrammarCompiler | None = None  # built on the first constraint

    def _grammar(self, req: Request):
        """The request's grammar matcher (its spec compiled, or from the cache), or a
        ValueError naming why it cannot have one."""
        if self.structured_output_error is not None:
            raise ValueError(self.structured_output_error)
        if len(req.prompt) < 2:
            raise ValueError("prompt must hold at least 2 tokens for structured output (its "
                             "first token is sampled by a decode step after the last prompt "
                             "token, under the grammar's mask)")
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_output: needs a tokenizer; this model "
                                 "directory has none")
            self._grammars = GrammarCompiler(self.tokenizer,
                                             self.vocab_size or self.tokenizer.vocab_size,
                                             self.eos_ids)
        return self._grammars.matcher(req.params.structured)

    def new_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    arrival: float) -> Request:
        """A request with its stop ids (EOS unless ``ignore_eos``) and its detokenizer;
        a ValueError for stop strings without a tokenizer."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        req = Request(request_id, prompt, params, arrival,
                      stop_ids=frozenset(params.stop_token_ids) | (
                          frozenset() if params.ignore_eos else self.eos_ids))
        if self.tokenizer is not None:
            from eagle_jax.tokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt)
        if params.structured is not None:
            req.grammar = self._grammar(req)
        return req

    def commit(self, req: Request, tokens: list[int],
               logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """Appends committed tokens, applying every stop condition in order."""
        p = req.params
        # Tokens the request may still take before a length limit ends it.
        room = self.max_model_len - len(req.prompt) - len(req.output)
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output))
        kept, reason, stop_reason = tokens, None, None
        stop = next((j for j, tok in enumerate(tokens) if tok in req.stop_ids), None)
        if stop is not None and stop < room:
            kept, reason = tokens[:stop + 1], "stop"
            stop_reason = tokens[stop] if tokens[stop] in p.stop_token_ids else None
        elif len(tokens) >= room:
            kept, reason = tokens[:room], "length"
        new_text = ""
        if req.detok is not None:
            new_text = req.detok.push(kept)
            if p.stop:
                new_text, kept, hit = self._apply_stop_strings(req, new_text, kept)
                if hit is not None:
                    reason, stop_reason = "stop", hit
            else:
                req.text += new_text
        req.output.extend(kept)
        if req.grammar is not None:
            req.grammar.advance(kept)
        lps = logprobs[:len(kept)] if logprobs is not None else None
        if lps:
            req.logprobs.extend(lps)
        if reason is not None:
            self.finish(req, reason, stop_reason)
        return self.output(req, kept, lps, new_text)

    def _apply_stop_strings(self, req: Request, new_text: str, kept: list[int]):
        """Cuts the text at the first stop string; drops the tokens past it.

        A stop string may span several tokens of one accepted run: the tokens after the
        one that completes the match are dropped, and the text ends before the match.
        """
        p = req.params
        before = len(req.text)
        text = req.text + new_text
        window_start = max(0, before - max(len(s) for s in p.stop) + 1)
        best = None
        for s in p.stop:
            i = text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            req.text = text
            return new_text, kept, None
        i, s = best
        end = i + len(s) if p.include_stop_str_in_output else i
        # Keep the tokens up to the one whose text completes the stop string.
        from eagle_jax.tokenizer import IncrementalDetokenizer

        probe = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt)
        probe.push(req.output)
        acc = req.text
        cut = len(kept)
        for j, tok in enumerate(kept):
            acc += probe.push([tok])
            if len(acc) >= i + len(s):
                cut = j + 1
                break
        req.text = text[:end]
        return text[before:end] if end > before else "", kept[:cut], s

    @staticmethod
    def finish(req: Request, reason: str, stop_reason) -> None:
        req.finished = True
        req.finish_reason = reason
        req.stop_reason = stop_reason

    @staticmethod
    def output(req: Request, new_tokens, new_logprobs, new_text: str = "") -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=list(new_tokens), finished=req.finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            new_logprobs=new_logprobs, num_prompt_tokens=len(req.prompt),
            num_output_tokens=len(req.output), num_cached_tokens=req.num_cached_tokens,
            text=req.text, new_text=new_text, first_token_time=req.first_token_time)
