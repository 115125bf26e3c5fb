"""Structured output with exact speculative verification (issue 64), on the default pair.

Two engines, built once: the default target alone (the non-speculative reference), and
the default target speculating with the default EAGLE-3 draft's weights over a reduced
vocabulary (the published EAGLE-3 layout, ``d2t``) that holds no all-digit token: under a
digits-only regex every token the draft proposes is one the grammar forbids (its masked
logits are all -inf, so it draws from the whole of its vocabulary), while under the
other grammars it drafts as the default draft does. Constrained greedy output of the
speculating engine equals the target's own constrained greedy output; every output
parses or matches; sampled output follows the target's masked distribution at every
position; free requests beside constrained ones are unchanged; the server takes the
OpenAI and vLLM fields, streams, and answers a bad schema with a 400.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax import SamplingParams, StructuredOutput
from eagle_jax.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from eagle_jax.checkpoint import CheckpointReader, save_safetensors
from eagle_jax.engine import LLM, EngineConfig
from eagle_jax.grammar import GrammarCompiler, fill_masks, num_mask_words
from eagle_jax.kernels.filters import apply_token_bitmask
from eagle_jax.testutil.stats import chi2_pvalue

SMALL = dict(dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=(4,),
             prefill_buckets=(32,), compilation_cache_dir="", precompile=False, seed=0)
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
def plain():
    return LLM(EngineConfig(model=DEFAULT_TARGET, speculative_algorithm="NONE", **SMALL))


@pytest.fixture(scope="module")
def target_logits(plain):
    """ids (at most 64) -> the target's logits [len(ids), V] (float64): one forward of the
    target's own module over the whole sequence, no KV pool (the reference)."""
    forward = nnx.jit(lambda model, ids: model(ids, jnp.arange(ids.shape[1])[None],
                                               None).logits)

    def logits(ids):
        padded = np.zeros((1, 64), np.int32)
        padded[0, :len(ids)] = ids
        out = forward(plain.engine.target, jnp.asarray(padded))[0, :len(ids)]
        return np.asarray(out, np.float64)

    return logits


def _digit_free_draft(out_dir: str, tokenizer) -> str:
    """The default draft over the target ids that are neither all digits nor special:
    its LM head the target's (tied) rows of those ids, ``d2t`` / ``t2d`` mapping them."""
    ids = np.array([i for i in range(tokenizer.vocab_size)
                    if i not in set(tokenizer.all_special_ids)
                    and not re.fullmatch(rb"[0-9]+", tokenizer.token_bytes(i))])
    reader = CheckpointReader(DEFAULT_DRAFT)
    tensors = {k: np.asarray(reader.get(k), np.float32) for k in reader.keys()
               if k not in ("d2t", "t2d")}
    embed = np.asarray(CheckpointReader(DEFAULT_TARGET).get("model.embed_tokens.weight"),
                       np.float32)
    tensors["lm_head.weight"] = embed[ids]
    tensors["d2t"] = (ids - np.arange(len(ids))).astype(np.int64)
    t2d = np.zeros(tokenizer.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    os.makedirs(out_dir)
    save_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(DEFAULT_DRAFT, "config.json")) as f:
        config = json.load(f)
    config.update(draft_vocab_size=len(ids), torch_dtype="float32")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


@pytest.fixture(scope="module")
def spec(tmp_path_factory, plain):
    draft = _digit_free_draft(str(tmp_path_factory.mktemp("draft") / "d"), plain.tokenizer)
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
    for name, r in zip(names, ref):
        _check_valid(name, r)
    stats = spec.engine.stats
    # Digits: every draft token is one the grammar forbids, and none is accepted.
    accepted, steps = stats.num_accepted_tokens, stats.num_steps
    assert _greedy(spec, ["digits"])[0].token_ids == ref[3].token_ids
    assert stats.num_accepted_tokens == accepted and stats.num_steps > steps
    out = _greedy(spec, names[:3])
    for name, o, r in zip(names, out, ref):
        assert o.token_ids == r.token_ids, (name, o.text, r.text)
    # Elsewhere the masked draft agrees with the target often enough to matter.
    assert (stats.num_accepted_tokens - accepted) / (stats.num_steps - steps) > 0.5, stats


def test_free_requests_beside_constrained_ones_are_unchanged(spec, target_logits):
    """Free greedy requests in a constrained step (the whole batch runs the constrained
    variant) give the target's own greedy output: each token the argmax of the
    reference forward over the sequence before it."""
    free = ["def fibonacci(n):", "import os\n"]
    params = SamplingParams(temperature=0, max_tokens=24)
    mixed = spec.generate(
        [free[0], CONSTRAINTS["json"][1], free[1], CONSTRAINTS["regex"][1]],
        [params, SamplingParams(temperature=0, max_tokens=48,
                                structured=CONSTRAINTS["json"][0]),
         params, SamplingParams(temperature=0, max_tokens=48,
                                structured=CONSTRAINTS["regex"][0])], use_tqdm=False)
    for text, out in ((free[0], mixed[0]), (free[1], mixed[2])):
        ids = spec.tokenizer.encode(text)
        for token in out.token_ids:
            assert token == int(np.argmax(target_logits(ids)[-1][:spec.engine.vocab_size]))
            ids = ids + [token]
    _check_valid("json", mixed[1])
    _check_valid("regex", mixed[3])


def test_sampled_constrained_output_follows_the_masked_target(spec, target_logits):
    """Every token of 24 sampled requests (temperature 1, the JSON schema and the digits
    regex, 16 tokens each) against the target's distribution renormalised over the
    tokens the grammar allows there: each token's randomised probability integral
    transform, F(t - 1) + v p'(t) with v ~ U(0, 1) and F the masked CDF in id order, is
    uniform and independent across positions exactly when the tokens follow p'
    (whatever the draft proposed). A chi-square test of 10 bins; fixed seeds; the test
    fails at p < 1e-3 (the false-alarm rate of a correct sampler)."""
    engine, tok = spec.engine, spec.tokenizer
    compiler = GrammarCompiler(tok, engine.vocab_size, engine.eos_ids)
    words = num_mask_words(compiler.vocab_size)
    rng = np.random.default_rng(0)
    pits = []
    for name in ("json", "digits"):
        constraint, text = CONSTRAINTS[name]
        prompt = tok.encode(text)
        # Four at a time: each batch is prefilled alone (no chunks ride in a step,
        # whose executables would be compiled for this test alone).
        outs = [o for j in range(0, 12, 4) for o in spec.generate([prompt] * 4, [
            SamplingParams(temperature=1.0, max_tokens=16, seed=200 + i,
                           structured=constraint) for i in range(j, j + 4)], use_tqdm=False)]
        for o in outs:
            logits = target_logits(prompt + o.token_ids)[:, :compiler.vocab_size]
            matcher = compiler.matcher(constraint)
            for k, token in enumerate(o.token_ids):
                mask = fill_masks({0: matcher}, np.zeros((1, 0), np.int32), words)[0]
                cols = np.arange(compiler.vocab_size)
                allowed = ((mask.view(np.uint32)[cols // 32] >> (cols % 32)) & 1) == 1
                x = logits[len(prompt) - 1 + k]
                p = np.where(allowed, np.exp(x - x[allowed].max()), 0.0)
                p /= p.sum()
                assert p[token] > 0, (name, o.token_ids, k, "sampled a forbidden token")
                pits.append(p[:token].sum() + rng.uniform() * p[token])
                matcher.advance([token])
    counts = np.histogram(np.clip(pits, 0, 1 - 1e-12), bins=10, range=(0, 1))[0]
    assert len(pits) > 300
    assert chi2_pvalue(counts, np.full(10, 0.1)) > 1e-3, counts


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


def _sentencepiece_tokenizer():
    """A Llama-2-style Hugging Face tokenizer (``tokenizers``: BPE over "▁"-joined words
    with byte fallback), trained on a few lines."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, trainers

    from eagle_jax.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=[f"<0x{b:02X}>" for b in range(256)], min_frequency=1)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog 0123456789",
                             "name: value, size: 42, ok: true"] * 20, trainer)
    return Tokenizer(tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("which", ["default", "sentencepiece"])
def test_grammar_masks_allow_exactly_the_structure(which, plain):
    """With the default pair's byte-level BPE and with a SentencePiece-style Hugging Face
    tokenizer: the tokens of a matching text are allowed one by one, EOS only at the
    end, and a token that breaks the regex is not."""
    tok = plain.tokenizer if which == "default" else _sentencepiece_tokenizer()
    eos = tok.eos_token_ids
    compiler = GrammarCompiler(tok, tok.vocab_size, eos)
    # (A SentencePiece piece "▁the" is " the" wherever it is generated.)
    spec = StructuredOutput("regex", r" ?the (quick|lazy) [a-z]+ 4[0-9]")
    assert compiler.compile(spec) is compiler.compile(spec)  # cached by its spec
    matcher = compiler.matcher(spec)
    words = num_mask_words(tok.vocab_size)
    ids = tok.encode("the lazy fox 42", add_special_tokens=False)

    def allowed(token):
        mask = fill_masks({0: matcher}, np.zeros((1, 0), np.int32), words)[0]
        return bool((int(mask.view(np.uint32)[token // 32]) >> (token % 32)) & 1)

    for i, t in enumerate(ids):
        assert allowed(t) and not allowed(eos[0]), (i, t)
        matcher.advance([t])
    assert allowed(eos[0])
    bad = tok.encode("the lazy fox 5", add_special_tokens=False)[-1]
    assert not allowed(bad)


def test_constraints_a_tree_engine_or_a_one_token_prompt_cannot_take(plain):
    from eagle_jax.engine import Engine

    params = SamplingParams(temperature=0, structured=CONSTRAINTS["digits"][0])
    with pytest.raises(ValueError, match="prompt must hold at least 2 tokens"):
        plain.engine.add_request("one", [5], params)
    tree = Engine(EngineConfig(model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT,
                               speculative_algorithm="EAGLE3", num_steps=2,
                               speculative_eagle_topk=2, num_draft_tokens=4, **SMALL))
    with pytest.raises(ValueError, match="tree drafting"):
        tree.add_request("tree", [5, 6, 7], params)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=CONSTRAINTS["digits"][0])


def test_wire_fields_read_into_one_constraint():
    from eagle_jax.server.structured import StructuredOutputError, structured_output

    none = {"json": None, "regex": None, "choice": None, "grammar": None}
    schema = {"type": "object"}
    assert structured_output({"type": "text"}, None, none) is None
    assert structured_output({"type": "json_object"}, None, none) == StructuredOutput(
        "json_object")
    assert structured_output({"type": "json_schema", "json_schema": {"schema": schema}},
                             None, none) == StructuredOutput("json", json.dumps(schema))
    assert structured_output(None, {"choice": ["a", "b"]}, none) == StructuredOutput(
        "choice", choices=("a", "b"))
    assert structured_output(None, None, {**none, "json": json.dumps(schema)}) == (
        StructuredOutput("json", json.dumps(schema)))
    assert structured_output(None, {"grammar": 'root ::= "x"'}, none).kind == "grammar"
    for args, param in [(({"type": "xml"}, None, none), "response_format.type"),
                        ((None, {"regex": ""}, none), "structured_outputs.regex"),
                        ((None, None, {**none, "choice": "ab"}), "guided_choice"),
                        ((None, {"regex": "a"}, {**none, "regex": "a"}), "response_format")]:
        with pytest.raises(StructuredOutputError) as err:
            structured_output(*args)
        assert err.value.param == param


def test_without_the_grammar_engine_a_constraint_names_the_extra(monkeypatch):
    """xgrammar is the "structured" extra: where it is missing, a constrained request is
    a ValueError (the server's 400) naming the extra, not an ImportError."""
    import sys

    from eagle_jax import grammar

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises
    with pytest.raises(ValueError, match=r"pip install 'eagle_jax\[structured\]'"):
        grammar.import_xgrammar()


def test_step_listeners_get_every_step_a_call_collects(spec):
    """A constrained step is read in the call that dispatches it, behind the free step
    in flight (async scheduling): that call collects two steps, and step listeners (the
    evaluation's per-step records) get an event for each, with the outputs each gave."""
    engine = spec.engine
    events, returned, calls = [], [], 0

    def listener(event):
        events.append(event)

    def step():
        nonlocal calls
        calls += 1
        returned.extend(engine.step())

    before = copy.deepcopy(engine.stats)
    engine.add_step_listener(listener)
    try:
        engine.add_request("free", spec.tokenizer.encode("def fibonacci(n):"),
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while not any(o.request_id == "free" and o.new_token_ids for o in returned):
            step()
        step()  # the free request's next step, in flight
        engine.add_request("json", spec.tokenizer.encode(CONSTRAINTS["json"][1]),
                           SamplingParams(temperature=0, max_tokens=24,
                                          structured=CONSTRAINTS["json"][0]))
        while engine.has_unfinished_requests():
            step()
    finally:
        engine.remove_step_listener(listener)
    stats = engine.stats
    collected = [e for e in events if e.output is not None]
    assert len(events) > calls  # a call collected two steps
    assert len(collected) == stats.num_steps - before.num_steps
    assert [e.step for e in collected] == list(range(before.num_steps + 1,
                                                     stats.num_steps + 1))
    assert sum(int(e.output.num_tokens[list(e.rows)].sum()) for e in collected) == (
        stats.num_emitted_tokens - before.num_emitted_tokens)
    assert [id(o) for e in events for o in e.outputs] == [id(o) for o in returned]
