"""Many sampled requests of one prompt through an engine, for goodness-of-fit tests."""

from __future__ import annotations

from eagle_jax.sampling import SamplingParams


def sample_prompt(engine, prompt: list[int], num_requests: int, max_tokens: int, *,
                  temperature: float, top_k: int, top_p: float) -> dict[str, list[int]]:
    """``num_requests`` requests of ``prompt`` (ids "0", "1", ..., seeds 1000 + i), each
    generating ``max_tokens`` tokens past EOS, run to the end. Returns id -> tokens."""
    for i in range(num_requests):
        engine.add_request(str(i), prompt, SamplingParams(
            temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens,
            seed=1000 + i, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out
