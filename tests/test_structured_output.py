"""Structured output with exact speculative verification (issue 64), on the default pair.

Three engines, built once: the default pair speculating (EAGLE-3, S = 3), the default
target alone (the non-speculative reference), and the default target with a random
EAGLE-3 draft whose reduced vocabulary holds no token a digits-only regex allows (every
token it proposes is disallowed). Constrained greedy output of the speculating engines
equals the target's own constrained greedy output; every output parses or matches; the
sampled output's first two tokens follow the target's masked distribution; free requests
beside constrained ones are unchanged; the server takes the OpenAI and vLLM fields,
streams, and answers a bad schema with a 400.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import SamplingParams, StructuredOutput
from eagle_jax.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from eagle_jax.engine import LLM, EngineConfig
from eagle_jax.grammar import GrammarCompiler, fill_masks, num_mask_words
from eagle_jax.kernels.filters import apply_token_bitmask
from eagle_jax.testutil.stats import chi2_pvalue

SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=(4,),
             prefill_buckets=(64,), compilation_cache_dir="", precompile=False, seed=0)
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"}},
          "required": ["name", "size", "ok"], "additionalProperties": False}
REGEX = r"def [a-z_]{1,12}\(self(, [a-z]{1,6}){0,2}\):"
CHOICES = ("self.assertEqual(", "self.assertTrue(", "return None")
DIGITS = r"[0-9]{16}"
CONSTRAINTS = {
    "json": (StructuredOutput("json", json.dumps(SCHEMA)), "# config\nrecord = "),
    "regex": (StructuredOutput("regex", REGEX), "class Stack:\n    "),
    "choice": (StructuredOutput("choice", choices=CHOICES), "    def test_push(self):\n        "),
    "digits": (StructuredOutput("regex", DIGITS), "MAGIC = "),
}


@pytest.fixture(scope="module")
def spec():
    return LLM(EngineConfig(model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT,
                            speculative_algorithm="EAGLE3", num_steps=3, **SMALL))


@pytest.fixture(scope="module")
def plain():
    return LLM(EngineConfig(model=DEFAULT_TARGET, speculative_algorithm="NONE", **SMALL))


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory, plain):
    """The default target with a random EAGLE-3 draft whose 512-token vocabulary holds no
    all-digit token and no special token: under DIGITS it proposes only tokens the
    grammar forbids (its masked logits are all -inf, so it draws from all of them)."""
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft

    tok = plain.tokenizer
    forbidden = set(tok.all_special_ids) | {
        i for i in range(tok.vocab_size) if re.fullmatch(rb"[0-9]+", tok.token_bytes(i))}
    rng = np.random.default_rng(7)
    ids = rng.choice([i for i in range(tok.vocab_size) if i not in forbidden], 512,
                     replace=False)
    draft = write_tiny_eagle3_draft(str(tmp_path_factory.mktemp("adv") / "draft"),
                                    DEFAULT_TARGET, draft_vocab_ids=sorted(ids.tolist()))
    return LLM(EngineConfig(model=DEFAULT_TARGET, draft_model=draft,
                            speculative_algorithm="EAGLE3", num_steps=3, **SMALL))


def _greedy(llm, names, max_tokens=48):
    prompts = [CONSTRAINTS[n][1] for n in names]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens,
                             structured=CONSTRAINTS[n][0]) for n in names]
    return llm.generate(prompts, params, use_tqdm=False)


def _check_valid(name, out):
    assert out.finish_reason == "stop", (name, out.text, out.finish_reason)
    assert out.token_ids[-1] == 0  # EOS, allowed once the structure was complete
    if name == "json":
        value = json.loads(out.text)
        assert set(value) == {"name", "size", "ok"}, value
        assert isinstance(value["name"], str) and len(value["name"]) <= 10
        assert type(value["size"]) is int and 0 <= value["size"] <= 999
        assert isinstance(value["ok"], bool)
    elif name == "choice":
        assert out.text in CHOICES
    else:
        assert re.fullmatch(REGEX if name == "regex" else DIGITS, out.text), out.text


def test_token_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 2, 100)).astype(np.float32)
    bitmask = rng.integers(-2**31, 2**31, (3, 2, 3), dtype=np.int64).astype(np.int32)
    out = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    cols = np.arange(100)
    allowed = (bitmask.view(np.uint32)[..., np.minimum(cols // 32, 2)] >> (cols % 32)) & 1
    allowed &= cols < 96  # past 32 W words: not allowed
    np.testing.assert_array_equal(out, np.where(allowed == 1, logits, -np.inf))


def test_constrained_greedy_speculative_equals_plain_and_parses(spec, plain):
    names = ["json", "regex", "choice", "digits"]
    ref = _greedy(plain, names)
    out = _greedy(spec, names)
    for name, o, r in zip(names, out, ref):
        _check_valid(name, r)
        assert o.token_ids == r.token_ids, (name, o.text, r.text)
    # The masked draft still agrees with the target often enough to matter.
    assert spec.engine.stats.mean_accept_length > 1.5, spec.engine.stats


def test_draft_of_disallowed_tokens_stays_exact(adversarial, plain):
    ref = _greedy(plain, ["digits"] * 2)
    before = adversarial.engine.stats.num_accepted_tokens
    out = _greedy(adversarial, ["digits"] * 2)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    _check_valid("digits", out[0])
    assert adversarial.engine.stats.num_accepted_tokens == before  # none was allowed
    sampled = adversarial.generate(
        [CONSTRAINTS["digits"][1]] * 4,
        [SamplingParams(temperature=1.0, max_tokens=24, seed=i,
                        structured=CONSTRAINTS["digits"][0]) for i in range(4)],
        use_tqdm=False)
    for o in sampled:
        _check_valid("digits", o)


def test_free_requests_beside_constrained_ones_are_unchanged(spec):
    free = ["def fibonacci(n):", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = spec.generate(free, params, use_tqdm=False)
    mixed = spec.generate(
        [free[0], CONSTRAINTS["json"][1], free[1], CONSTRAINTS["regex"][1]],
        [params, SamplingParams(temperature=0, max_tokens=48,
                                structured=CONSTRAINTS["json"][0]),
         params, SamplingParams(temperature=0, max_tokens=48,
                                structured=CONSTRAINTS["regex"][0])], use_tqdm=False)
    assert [mixed[0].token_ids, mixed[2].token_ids] == [a.token_ids for a in alone]
    _check_valid("json", mixed[1])
    _check_valid("regex", mixed[3])


def _masked_probs(llm, compiler, spec, prompt, prefix):
    """The target's next-token distribution after prompt + prefix, renormalised over the
    tokens the grammar allows after ``prefix`` (float64)."""
    ids = prompt + prefix
    logits = llm.engine.target(jnp.asarray([ids]), jnp.arange(len(ids))[None], None).logits
    logits = np.asarray(logits[0, -1], np.float64)[:compiler.vocab_size]
    matcher = compiler.matcher(spec)
    matcher.advance(prefix)
    words = num_mask_words(compiler.vocab_size)
    mask = fill_masks({0: matcher}, np.zeros((1, 0), np.int32), words)[0]
    cols = np.arange(compiler.vocab_size)
    allowed = ((mask.view(np.uint32)[cols // 32] >> (cols % 32)) & 1) == 1
    p = np.where(allowed, np.exp(logits - logits[allowed].max()), 0.0)
    return p / p.sum()


def test_sampled_constrained_output_follows_the_masked_target(spec):
    """Goodness of fit of the first two tokens of 240 sampled requests (temperature 1,
    the choice grammar) against the exact masked distribution p'(t1) p'(t2 | t1), from
    the target's own logits and the grammar. Outcomes of expected count < 5 are pooled.
    Fixed seeds; the test fails at p < 1e-3 (the false-alarm rate of a correct sampler)."""
    engine = spec.engine
    constraint, text = CONSTRAINTS["choice"]
    prompt = spec.tokenizer.encode(text)
    compiler = GrammarCompiler(spec.tokenizer, engine.vocab_size, engine.eos_ids)
    n = 240
    outs = spec.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=2,
                                                      seed=100 + i, structured=constraint)
                                       for i in range(n)], use_tqdm=False)
    p1 = _masked_probs(spec, compiler, constraint, prompt, [])
    expected = {}
    for t1 in np.flatnonzero(p1 > 1e-4):
        if t1 in engine.eos_ids:
            expected[(int(t1),)] = p1[t1]
            continue
        p2 = _masked_probs(spec, compiler, constraint, prompt, [int(t1)])
        for t2 in np.flatnonzero(p2 > 0):
            expected[(int(t1), int(t2))] = p1[t1] * p2[t2]
    observed = {}
    for o in outs:
        key = tuple(o.token_ids[:2])
        assert key in expected, (key, "sampled outside the masked support")
        observed[key] = observed.get(key, 0) + 1
    keys = sorted(expected, key=lambda k: -expected[k])
    big = [k for k in keys if expected[k] * n >= 5]
    obs = [observed.get(k, 0) for k in big] + [n - sum(observed.get(k, 0) for k in big)]
    exp = [expected[k] for k in big] + [1.0 - sum(expected[k] for k in big)]
    assert len(big) >= 2, expected
    assert chi2_pvalue(obs, np.maximum(exp, 0.0)) > 1e-3, (obs, exp)


def _run_app(llm, requests):
    """``requests`` (async callables of an httpx client) against the app of ``llm``'s
    engine, in process; their results."""
    from eagle_jax.server import create_app

    app = create_app(llm.engine)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=300) as client:
                return [await r(client) for r in requests]

    return asyncio.run(main())


def test_server_fields_stream_and_bad_schemas(spec):
    completion = {"prompt": CONSTRAINTS["json"][1], "max_tokens": 48, "temperature": 0}

    async def schema_response(c):
        return await c.post("/v1/completions", json={**completion, "response_format": {
            "type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}})

    async def streamed_choice(c):
        return await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "pick one"}], "max_tokens": 32,
            "temperature": 0, "stream": True, "structured_outputs": {"choice": list(CHOICES)}})

    async def guided_regex(c):
        return await c.post("/v1/completions", json={
            **completion, "prompt": CONSTRAINTS["regex"][1], "guided_regex": REGEX})

    def bad(body):
        return lambda c: c.post("/v1/completions", json={**completion, **body})

    results = _run_app(spec, [
        schema_response, streamed_choice, guided_regex,
        bad({"response_format": {"type": "json_schema",
                                 "json_schema": {"schema": {"type": "no-such-type"}}}}),
        bad({"guided_regex": "(unclosed"}),
        bad({"guided_json": "{not json"}),
        bad({"guided_choice": ["a"], "guided_regex": "a"})])
    schema_r, stream_r, regex_r, *bad_rs = results
    assert schema_r.status_code == 200, schema_r.text
    assert json.loads(schema_r.json()["choices"][0]["text"])["name"] is not None
    assert stream_r.status_code == 200, stream_r.text
    from eagle_jax.testutil.server import parse_sse

    events = parse_sse(stream_r.text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e["choices"])
    assert text in CHOICES, text
    assert regex_r.status_code == 200 and re.fullmatch(REGEX, regex_r.json()["choices"][0]["text"])
    for r, word in zip(bad_rs, ["JSON schema", "regex", "guided_json", "one structured"]):
        assert r.status_code == 400, r.text
        assert word in r.json()["error"]["message"], r.text
