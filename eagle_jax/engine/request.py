"""A request's host-side record, and the one validation of prompts.

The scheduler owns every ``Request`` and is the only writer of its bookkeeping fields
(``slot``, ``seq_len``, ``in_flight``, ``draft_lag``, ``in_prefill``); the output
processor writes its output fields (``output``, ``logprobs``, ``text``, the finish).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eagle_jax.engine.page_allocator import page_hashes
from eagle_jax.engine.types import TokenLogprob
from eagle_jax.sampling import SamplingParams


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float
    slot: int = -1
    seq_len: int = 0  # tokens in the KV pool after the collected steps (or prefill chunks)
    in_prefill: bool = False  # holds a slot, its known tokens not all prefilled yet
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (first admission)
    page_keys: list = dataclasses.field(default_factory=list)  # of its full pages' tokens
    in_flight: int = 0  # steps dispatched for it whose tokens are not collected yet
    draft_lag: int = 0  # steps of draft length 0 dispatched since its draft caught up
    preemptions: int = 0  # also tags in-flight steps: a preempted request's are dropped
    admitted: int = 0  # admission order (the newest running request is preempted first)
    seed: int | None = None  # drawn at the first admission, kept across preemptions
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    detok: object = None
    stop_ids: frozenset = frozenset()  # stop token ids, EOS included unless ignore_eos
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    grammar: object = None  # structured output's grammar.RequestGrammar, or None

    @property
    def samples_first_token(self) -> bool:
        """Whether its last prefill chunk samples its first token: a new request's,
        unless constrained. A constrained request's prefill stops one position short
        and takes its last prompt token as last_token, so that its first token is
        sampled by a decode step, under the grammar's mask as every later one is."""
        return not self.output and self.grammar is None

    def known_tokens(self) -> list[int]:
        """Every token whose position the request knows: its prompt and output (the
        newest, ``last_token``, is not in the pool yet)."""
        return self.prompt + self.output

    def known_token(self, position: int) -> int | None:
        """The token at ``position`` (``known_tokens()[position]`` without gathering them
        all: this runs for every prefilling request each step), or None where it is not
        known yet."""
        if position < len(self.prompt):
            return self.prompt[position]
        position -= len(self.prompt)
        return self.output[position] if position < len(self.output) else None

    @property
    def prefill_len(self) -> int:
        """Positions its prefill computes: a new request's prompt; one resumed after a
        preemption (or a constrained one), its known tokens but the last (which becomes
        last_token)."""
        return len(self.prompt) + len(self.output) - (0 if self.samples_first_token else 1)

    def full_page_keys(self, page_size: int, tokens: list[int] | None = None) -> list[bytes]:
        """The prefix-cache keys of its full pages, extended as it grows (its tokens
        gathered only then, or given as ``tokens`` by a caller that has them)."""
        if len(self.page_keys) < (len(self.prompt) + len(self.output)) // page_size:
            self.page_keys = page_hashes(self.known_tokens() if tokens is None else tokens,
                                         page_size, self.page_keys)
        return self.page_keys


def validate_prompt(prompt_token_ids, vocab_size: int, max_model_len: int, *,
                    generates: bool = True) -> list[int]:
    """The prompt as a list of ints, or a ValueError naming the problem: empty, not
    integers, an id outside [0, vocab_size), or too long for ``max_model_len`` (with
    room for one generated token when it ``generates``).

    Checked by type and with numpy, not token by token in Python: a long prompt's checks
    are on its time to first token."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    kinds = set(map(type, prompt))
    if bool in kinds or not all(issubclass(k, (int, np.integer)) for k in kinds):
        raise ValueError("prompt token ids must be integers")
    try:
        ids = np.asarray(prompt, np.int64)
    except OverflowError:
        ids = None
    if ids is None or ids.min() < 0 or ids.max() >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) + generates > max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens; with at least one generated token it "
            f"exceeds max_model_len {max_model_len}" if generates else
            f"the prompt has {len(prompt)} tokens, over max_model_len {max_model_len}")
    return ids.tolist()


def threefry_key(seed: int) -> np.ndarray:
    """A raw threefry2x32 key [2] u32 from the seed's 64 bits (high word, low word).

    Built on the host: no device round trip, so admitting a request never waits for the
    step in flight. (``jax.random.PRNGKey`` would also keep only the low 32 bits.)"""
    seed &= (1 << 64) - 1
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
