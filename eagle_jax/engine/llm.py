"""Offline batch generation: ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
from tqdm.auto import tqdm

from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.data_parallel import make_engine
from eagle_jax.engine.protocol import EngineClient
from eagle_jax.engine.types import CompletionOutput
from eagle_jax.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """An engine with a blocking batch API, as vLLM's ``LLM``.

    ``LLM(model=..., draft_model=..., speculative_algorithm="EAGLE3", ...)`` takes the
    fields of EngineConfig as keyword arguments (``data_parallel_size`` > 1: replicas,
    ``make_engine``); ``engine``: an engine built by the caller instead.
    """

    def __init__(self, config: EngineConfig | None = None, *,
                 engine: EngineClient | None = None, **kwargs):
        if engine is None:
            engine = make_engine(config if config is not None else EngineConfig(**kwargs))
        self.engine = engine
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return self.engine.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[CompletionOutput]:
        """Runs every prompt to completion with continuous batching; outputs in order."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        encoded = [self._encode(p) for p in prompts]
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, tokens, p in zip(ids, encoded, params):
            self.engine.add_request(rid, tokens, p)  # validates every prompt up front
        results: dict[str, CompletionOutput] = {
            rid: CompletionOutput(rid, tokens, [], "", None, logprobs=[] if p.logprobs is not None
                                  else None)
            for rid, tokens, p in zip(ids, encoded, params)}
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, leave=False)
        pending = set(ids)
        while pending:
            for out in self.engine.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.token_ids.extend(out.new_token_ids)
                if out.new_logprobs:
                    res.logprobs.extend(out.new_logprobs)
                res.text = out.text
                if out.finished:
                    res.finish_reason, res.stop_reason = out.finish_reason, out.stop_reason
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]
