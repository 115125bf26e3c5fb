"""The OpenAI-compatible server, end to end: scripts/serve.py in a subprocess, real clients.

One server per module fixture (tiny random Llama target + EAGLE-3 draft, float32 on CPU);
a second, small one checks the API key and the 503 of a full queue.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from eagle_jax.testutil.tokenizer import write_test_tokenizer
from eagle_jax.testutil.server import ServerProcess, parse_sse

VOCAB = 512
EOS_ID = 2  # "<|eos|>" of the test tokenizer
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
NUM_STEPS = 3
PREFILL_CHUNK = 64
NAME = "tiny-eagle"
MAX_BODY = 65536

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time there was a little server",
    "Numbers: 1 2 3",
]


def _write_models(root) -> tuple[str, str]:
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target

    target = os.path.join(root, "target")
    write_tiny_target(target, vocab_size=VOCAB, eos_token_id=EOS_ID,
                      max_position_embeddings=MAX_MODEL_LEN)
    write_test_tokenizer(target, VOCAB)
    draft = write_tiny_eagle3_draft(os.path.join(root, "draft"), target)
    return target, draft


def _engine_args(target, draft) -> list[str]:
    # One batch bucket and one prefill chunk length keep compilation short on a CPU; both
    # servers and the offline LLM share these shapes, so JAX's persistent compilation
    # cache serves the second and third compile.
    return ["--model", target, "--draft-model", draft,
            "--speculative-algorithm", "EAGLE3", "--num-steps", str(NUM_STEPS),
            "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--seed", "0",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--batch-buckets", str(MAX_NUM_SEQS),
            "--prefill-buckets", str(PREFILL_CHUNK)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _write_models(str(tmp_path_factory.mktemp("server_models")))


@pytest.fixture(scope="module")
def server(models):
    target, draft = models
    proc = ServerProcess(_engine_args(target, draft) + [
        "--max-queue-len", "128",
        "--served-model-name", NAME, "--log-interval", "1",
        "--max-body-bytes", str(MAX_BODY)])
    yield proc
    proc.stop()
    log = proc.log_text()
    assert "Traceback" not in log, log[-5000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in tokens]


def _greedy(http, prompt, max_tokens, **extra) -> tuple[list[int], str, dict]:
    r = http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    return _ids(ch["logprobs"]["tokens"]), ch["text"], body


def _metrics(http) -> dict:
    text = http.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def _m(metrics, name, **labels) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def _assert_error(r: httpx.Response, status: int, code=None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["object"] == "error"
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == (status if code is None else code)
    assert isinstance(err["type"], str) and err["type"].endswith("Error")
    return err


# --------------------------------------------------------------------------- routes
def test_health_models_tokenizer_info(server, http, client):
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    (m,) = models["data"]
    assert m["id"] == NAME and m["object"] == "model" and m["owned_by"]
    assert m["max_model_len"] == MAX_MODEL_LEN and isinstance(m["created"], int) and m["root"]
    assert [x.id for x in client.models.list().data] == [NAME]
    info = http.get("/tokenizer_info").json()
    assert info["eos_token_ids"] == [EOS_ID] and info["bos_token_id"] == 1
    assert info["vocab_size"] == VOCAB and info["model_max_length"] == MAX_MODEL_LEN
    assert "<|assistant|>" in info["chat_template"]


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"][0] == 1 and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    r2 = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r2["tokens"] == r["tokens"][1:]
    assert http.post("/detokenize", json={"tokens": r2["tokens"]}).json() == {
        "prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text == "<|bos|><|user|>\nHi<|end|>\n<|assistant|>\n"
    _assert_error(http.post("/detokenize", json={"tokens": [VOCAB]}), 400)
    _assert_error(http.post("/tokenize", json={}), 400)


# ----------------------------------------------------------------------- completions
def test_completion_openai_client(client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    (ch,) = r.choices
    assert ch.index == 0 and ch.finish_reason == "length" and isinstance(ch.text, str)
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(client._client.post(
        str(client.base_url).replace("/v1/", "/tokenize"),
        json={"prompt": PROMPTS[0]}).json()["tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    # Default max_tokens of completions: 16.
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_completion_text_matches_tokens(http):
    ids, text, _ = _greedy(http, PROMPTS[2], 20, ignore_eos=True)
    assert len(ids) == 20
    detok = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    # The server's text skips special tokens; detokenize keeps them.
    for special in ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>",
                    "<|assistant|>", "<|end|>"):
        detok = detok.replace(special, "")
    assert text == detok


def test_greedy_matches_offline_llm(http, models):
    from eagle_jax import LLM
    from eagle_jax.engine import EngineConfig
    from eagle_jax.sampling import SamplingParams

    target, draft = models
    config = EngineConfig(model=target, draft_model=draft, speculative_algorithm="EAGLE3",
                          num_steps=NUM_STEPS, max_model_len=MAX_MODEL_LEN,
                          max_num_seqs=MAX_NUM_SEQS, batch_buckets=(MAX_NUM_SEQS,),
                          prefill_buckets=(PREFILL_CHUNK,), dtype="float32", seed=0,
                          precompile=False)
    llm = LLM(config)
    prompt_ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    offline = llm.generate([list(p) for p in prompt_ids], params)
    for p, ids, out in zip(PROMPTS, prompt_ids, offline):
        served, text, _ = _greedy(http, ids, 24, ignore_eos=True)
        assert served == list(out.token_ids), p
        assert text == out.text


def test_prompt_forms_and_choice_order(http):
    a, b = PROMPTS[0], PROMPTS[3]
    ids_a, _, _ = _greedy(http, a, 6, ignore_eos=True)
    ids_b, _, _ = _greedy(http, b, 6, ignore_eos=True)
    ta = http.post("/tokenize", json={"prompt": a}).json()["tokens"]
    tb = http.post("/tokenize", json={"prompt": b}).json()["tokens"]
    for prompt in ([a, b], [ta, tb]):
        r = http.post("/v1/completions", json={
            "prompt": prompt, "n": 2, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        got = [_ids(c["logprobs"]["tokens"]) for c in body["choices"]]
        assert got == [ids_a, ids_a, ids_b, ids_b]  # prompt-major; greedy n=2 are identical
        usage = body["usage"]
        assert usage.pop("prompt_tokens_details")["cached_tokens"] >= 0
        assert usage == {"prompt_tokens": len(ta) + len(tb), "completion_tokens": 24,
                         "total_tokens": len(ta) + len(tb) + 24}
    # A single list of token ids is one prompt.
    assert _greedy(http, ta, 6, ignore_eos=True)[0] == ids_a


def test_stop_strings_and_stop_token_ids(http):
    ids, text, _ = _greedy(http, PROMPTS[1], 30, ignore_eos=True)
    # A stop string taken from the middle of the greedy text cuts the output before it.
    cut = next((k for k in range(3, len(text) - 2) if text[k:k + 2].strip()), None)
    if cut is not None:
        stop = text[cut:cut + 2]
        first = text.find(stop)
        r = http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 30,
                                               "temperature": 0, "ignore_eos": True,
                                               "stop": [stop, "@@never@@"]}).json()
        ch = r["choices"][0]
        assert ch["text"] == text[:first]
        assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    # stop_token_ids: generation ends at (and includes) the first occurrence.
    stop_id = ids[4]
    r = http.post("/v1/completions", json={
        "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True,
        "stop_token_ids": [stop_id], "logprobs": 0, "return_tokens_as_token_ids": True}).json()
    ch = r["choices"][0]
    got = _ids(ch["logprobs"]["tokens"])
    assert got == ids[:ids.index(stop_id) + 1]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop_id


def test_ignore_eos_and_eos(http):
    # With EOS as a stop token id the output ends at the first EOS, like ignore_eos=false.
    ids, _, body = _greedy(http, PROMPTS[0], 40, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == 40
    ids2, _, body2 = _greedy(http, PROMPTS[0], 40)
    if EOS_ID in ids:
        assert ids2 == ids[:ids.index(EOS_ID) + 1]
        assert body2["choices"][0]["finish_reason"] == "stop"
    else:
        assert ids2 == ids


def test_seeded_sampling(http):
    def sample(seed, n=1):
        r = http.post("/v1/completions", json={
            "prompt": PROMPTS[2], "max_tokens": 12, "temperature": 1.0, "top_k": 50,
            "top_p": 0.95, "min_p": 0.01, "seed": seed, "n": n, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True})
        assert r.status_code == 200, r.text
        return [_ids(c["logprobs"]["tokens"]) for c in r.json()["choices"]]

    a = sample(1234)
    assert a == sample(1234)
    two = sample(1234, n=2)
    assert two[0] == a[0] and two[1] == sample(1235)[0]  # choice i uses seed + i


def test_completion_logprobs(http):
    r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8,
                                           "temperature": 0, "logprobs": 3,
                                           "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert v <= 0 and tok in top and 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(v, max(top.values()), abs_tol=1e-4)


def test_echo_prompt_logprobs_lm_eval_style(http):
    # lm-eval loglikelihood: echo, logprobs, max_tokens 0 -> the prompt and its logprobs.
    prompt = PROMPTS[2]
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                           "logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    assert ch["text"] == prompt
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0
    # The logprob of a greedy continuation token, echoed, equals its generation logprob.
    gen = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                             "temperature": 0, "logprobs": 1,
                                             "return_tokens_as_token_ids": True}).json()
    tid = _ids(gen["choices"][0]["logprobs"]["tokens"])[0]
    glp = gen["choices"][0]["logprobs"]["token_logprobs"][0]
    r2 = http.post("/v1/completions", json={"prompt": ids + [tid], "max_tokens": 0, "echo": True,
                                            "logprobs": 1}).json()
    assert math.isclose(r2["choices"][0]["logprobs"]["token_logprobs"][-1], glp, abs_tol=1e-3)
    # lm-eval's other form: max_tokens 1 with echo; the prompt part comes first.
    r3 = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True,
                                            "logprobs": 1, "temperature": 0}).json()
    lp3 = r3["choices"][0]["logprobs"]
    assert len(lp3["tokens"]) == len(ids) + 1
    assert r3["choices"][0]["text"].startswith(prompt)
    for a, b in zip(lp3["token_logprobs"][1:len(ids)], lp["token_logprobs"][1:]):
        assert math.isclose(a, b, abs_tol=1e-3)
    # Echo without logprobs, and echo-only streaming.
    r4 = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "echo": True,
                                            "temperature": 0}).json()
    assert r4["choices"][0]["text"].startswith(prompt) and r4["choices"][0]["logprobs"] is None
    r5 = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                            "stream": True})
    ev = parse_sse(r5.text)
    assert ev[-1] == "[DONE]" and ev[0]["choices"][0]["text"] == prompt
    # Echo-only streams end like every stream: the usage chunk, "usage": null before it.
    r6 = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                            "stream": True,
                                            "stream_options": {"include_usage": True}})
    ev = parse_sse(r6.text)
    assert ev[0]["usage"] is None and ev[0]["choices"][0]["finish_reason"] == "length"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 0
    assert ev[-1] == "[DONE]"


def test_completion_streaming(http, client):
    _, text, _ = _greedy(http, PROMPTS[3], 20, ignore_eos=True)
    for include_usage in (False, True):
        with http.stream("POST", "/v1/completions", json={
                "prompt": PROMPTS[3], "max_tokens": 20, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": include_usage}}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = parse_sse(r.read().decode())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        if include_usage:
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
            chunks = chunks[:-1]
        else:
            assert all("usage" not in c or c["usage"] is None for c in chunks)
        assert all(c["object"] == "text_completion" and len(c["choices"]) == 1 for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # The openai client parses the same stream.
    parts = list(client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=20,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == text


def test_streaming_n_and_logprobs(http):
    r = http.post("/v1/completions", json={
        "prompt": [PROMPTS[0], PROMPTS[1]], "n": 2, "max_tokens": 7, "temperature": 0,
        "ignore_eos": True, "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    events = parse_sse(r.text)
    toks = {i: [] for i in range(4)}
    finished = set()
    for ev in events[:-1]:
        (ch,) = ev["choices"]
        toks[ch["index"]] += _ids(ch["logprobs"]["tokens"])
        if ch["finish_reason"]:
            finished.add(ch["index"])
    assert finished == {0, 1, 2, 3} and all(len(t) == 7 for t in toks.values())
    assert toks[0] == toks[1] == _greedy(http, PROMPTS[0], 7, ignore_eos=True)[0]
    assert toks[2] == toks[3] == _greedy(http, PROMPTS[1], 7, ignore_eos=True)[0]


# ------------------------------------------------------------------------------ chat
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]


def test_chat_completion(client, http):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (ch,) = r.choices
    assert ch.message.role == "assistant" and ch.finish_reason == "length"
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert r.usage.prompt_tokens == prompt["count"] and r.usage.completion_tokens == 10
    # Equals a completion over the rendered template (no second BOS).
    ids, text, _ = _greedy(http, prompt["tokens"], 10, ignore_eos=True)
    assert ch.message.content == text
    # max_completion_tokens wins over max_tokens; default runs to the context limit.
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3,
                                       max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == MAX_MODEL_LEN - prompt["count"]
    assert r.choices[0].finish_reason == "length"
    # Content given as text parts.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]
    r2 = client.chat.completions.create(model=NAME, messages=parts, max_tokens=4, temperature=0)
    assert r2.choices[0].message.content is not None


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert bytes(item.bytes).decode(errors="replace") == item.token
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-4)
        assert [t.logprob for t in item.top_logprobs] == sorted(
            [t.logprob for t in item.top_logprobs], reverse=True)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                       temperature=0)
    assert r.choices[0].logprobs is None


def test_chat_streaming(client, http):
    full = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                          temperature=0, n=2, extra_body={"ignore_eos": True})
    for include_usage in (False, True):
        r = http.post("/v1/chat/completions", json={
            "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "n": 2, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": include_usage}})
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        if include_usage:
            usage = chunks.pop()
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
        texts, roles, finish = {0: "", 1: ""}, {}, {}
        for c in chunks:
            assert c["object"] == "chat.completion.chunk"
            (ch,) = c["choices"]
            i = ch["index"]
            if "role" in ch["delta"]:
                assert i not in roles and texts[i] == ""  # the role comes first
                roles[i] = ch["delta"]["role"]
            assert i not in finish  # nothing after the finish chunk
            texts[i] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finish[i] = ch["finish_reason"]
        assert roles == {0: "assistant", 1: "assistant"}
        assert finish == {0: "length", 1: "length"}
        assert texts[0] == texts[1] == full.choices[0].message.content
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    parts = list(stream)
    assert parts[-1].usage.completion_tokens == 12
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == \
        full.choices[0].message.content


# ---------------------------------------------------------------- concurrency, aborts
def test_64_concurrent_streams(server):
    rng = random.Random(0)
    jobs = [(rng.choice(PROMPTS) * rng.randint(1, 3), rng.randint(1, 40)) for _ in range(64)]

    async def one(c: httpx.AsyncClient, prompt, max_tokens):
        n_tok, usage, finish, text = 0, None, None, ""
        async with c.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.8, "stream": True, "logprobs": 0,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200, await r.aread()
            buf = ""
            async for part in r.aiter_text():
                buf += part
            for ev in parse_sse(buf)[:-1]:
                if ev["choices"]:
                    ch = ev["choices"][0]
                    n_tok += len(ch["logprobs"]["tokens"])
                    text += ch["text"]
                    finish = ch["finish_reason"] or finish
                else:
                    usage = ev["usage"]
        return n_tok, usage, finish

    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=240, limits=limits) as c:
            return await asyncio.gather(*(one(c, p, m) for p, m in jobs))

    t0 = time.monotonic()
    results = asyncio.run(main())
    for (prompt, max_tokens), (n_tok, usage, finish) in zip(jobs, results):
        assert n_tok == max_tokens and usage["completion_tokens"] == max_tokens
        assert finish == "length"
    print(f"64 concurrent streams: {time.monotonic() - t0:.1f}s")


def _wait_idle(http, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _metrics(http)
        if _m(m, "vllm:num_requests_running") == 0 and _m(m, "vllm:num_requests_waiting") == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout}s: {m}")


def test_disconnect_frees_slot(server, http):
    before = _wait_idle(http)
    for route, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                        ("/v1/chat/completions", {"messages": MESSAGES})):
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            with c.stream("POST", route, json={**body, "max_tokens": MAX_MODEL_LEN - 40,
                                              "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        break  # close after the first chunk
        after = _wait_idle(http)
    # A non-streaming request whose client times out is aborted too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", timeout=0.5, json={
            "prompt": PROMPTS[1], "max_tokens": MAX_MODEL_LEN - 40, "ignore_eos": True})
    after = _wait_idle(http)
    aborted = (_m(after, "vllm:request_success_total", finished_reason="abort")
               - _m(before, "vllm:request_success_total", finished_reason="abort"))
    assert aborted == 3
    # New requests are served.
    assert _greedy(http, PROMPTS[0], 5, ignore_eos=True)[2]["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------------ bad input
BAD_COMPLETIONS = [
    ({"prompt": "a", "temperature": -0.5}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "min_p": 1.5}, "min_p"),
    ({"prompt": "a", "min_p": -0.1}, "min_p"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "stop": 5}, "stop"),
    ({"prompt": "a", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "a", "seed": "x"}, "seed"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": {"text": "a"}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": [VOCAB]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [[5, 6], [VOCAB + 3]]}, "prompt"),
    ({"prompt": [5] * MAX_MODEL_LEN}, "prompt"),
    ({"prompt": "hello " * (MAX_MODEL_LEN + 10)}, "prompt"),
    ({"prompt": [5] * (MAX_MODEL_LEN + 1), "echo": True, "max_tokens": 0}, "prompt"),
]

BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # template raises
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MESSAGES, "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "x " * MAX_MODEL_LEN}]}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests(http, body, param):
    err = _assert_error(http.post("/v1/completions", json=body), 400)
    assert err["param"] == param or param in err["message"], err


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_bad_chat_requests(http, body, param):
    err = _assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == param or param in err["message"], err


def test_bad_requests_misc(server, http, client):
    h = {"content-type": "application/json"}
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        _assert_error(http.post(route, content=b"{not json", headers=h), 400)
        _assert_error(http.post(route, content=b"[1, 2]", headers=h), 400)
        _assert_error(http.post(route, content=b"\xff\xfe", headers=h), 400)
    _assert_error(http.post("/v1/completions", content=b'{"prompt": "a", "temperature": NaN}',
                            headers=h), 400)
    _assert_error(http.post("/v1/completions", content=b'{"prompt": "a", "top_p": Infinity}',
                            headers=h), 400)
    # Unknown model: 404 model_not_found, for completions, chat and the openai client.
    err = _assert_error(http.post("/v1/completions", json={"prompt": "a", "model": "gpt-4"}),
                        404, code="model_not_found")
    assert "gpt-4" in err["message"]
    _assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES, "model": "x"}),
                  404, code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="a", max_tokens=1, temperature=-1)
    # Unknown fields are ignored.
    r = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "frobnicate": 1})
    assert r.status_code == 200
    # Unknown routes and methods.
    _assert_error(http.get("/v1/nope"), 404)
    _assert_error(http.get("/v1/completions"), 405)
    # Body size: Content-Length over the limit, and a chunked body that grows past it.
    big = json.dumps({"prompt": "a", "pad": "x" * MAX_BODY}).encode()
    _assert_error(http.post("/v1/completions", content=big, headers=h), 413)

    def chunks():
        for k in range(0, len(big), 4096):
            yield big[k:k + 4096]

    _assert_error(http.post("/v1/completions", content=chunks(), headers=h), 413)
    # The prompt at the limit (max_model_len - 1 tokens) is accepted.
    r = http.post("/v1/completions", json={"prompt": [5] * (MAX_MODEL_LEN - 1), "max_tokens": 4,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1  # clipped to the context
    # Still serving.
    assert http.get("/health").status_code == 200
    assert _greedy(http, "a", 2, ignore_eos=True)[2]["usage"]["completion_tokens"] == 2


# -------------------------------------------------------------------------- metrics
def test_metrics_match_served(http):
    before = _wait_idle(http)
    total_completion, total_prompt, n_requests = 0, 0, 0
    for i, p in enumerate(PROMPTS):
        r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 10 + i, "n": 2,
                                               "ignore_eos": True, "temperature": 0.7}).json()
        total_completion += r["usage"]["completion_tokens"]
        total_prompt += 2 * r["usage"]["prompt_tokens"]  # each choice is an engine request
        n_requests += 2
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 7,
                                                "temperature": 0}).json()
    total_completion += r["usage"]["completion_tokens"]
    total_prompt += r["usage"]["prompt_tokens"]
    n_requests += 1
    after = _wait_idle(http)

    def d(name, **labels):
        return _m(after, name, **labels) - _m(before, name, **labels)

    served = sum(d("vllm:request_success_total", finished_reason=f)
                 for f in ("stop", "length", "abort"))
    assert served == n_requests
    assert d("vllm:generation_tokens_total") == total_completion
    assert d("vllm:prompt_tokens_total") == total_prompt
    assert d("vllm:e2e_request_latency_seconds_count") == n_requests
    assert d("vllm:time_to_first_token_seconds_count") == n_requests
    assert d("vllm:request_queue_time_seconds_count") == n_requests
    drafts = d("vllm:spec_decode_num_drafts_total")
    draft_tokens = d("vllm:spec_decode_num_draft_tokens_total")
    accepted = d("vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(k))
               for k in range(NUM_STEPS)]
    assert drafts > 0 and draft_tokens >= drafts and draft_tokens % drafts == 0
    assert sum(per_pos) == accepted <= draft_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # chain drafting
    assert all(p <= drafts for p in per_pos)
    # Every committed token is an accepted draft token or one bonus token per draft
    # (prefill adds one token per request; stops can cut a step short).
    assert total_completion <= accepted + drafts + n_requests
    # The draft-length histogram: one observation per step; the CPU's fixed policy drafts
    # NUM_STEPS in every step.
    steps = d("eagle_jax:spec_decode_draft_length_count")
    assert steps > 0 and d("eagle_jax:spec_decode_draft_length_sum") == NUM_STEPS * steps
    # Cumulative metrics parse, carry the model name, and all vLLM names are present.
    text = http.get("/metrics").text
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens",
                 "vllm:spec_decode_num_accepted_tokens_per_pos", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:request_success", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:time_to_first_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits"):
        assert name in names, name
    assert f'model_name="{NAME}"' in text
    assert _m(after, "vllm:kv_cache_usage_perc") == 0.0  # idle: every page free


def test_prefix_cache_hits_show_in_usage_and_metrics(http):
    """The second request with a prompt the first computed is served its full pages from
    the prefix cache: OpenAI's usage.prompt_tokens_details.cached_tokens says how many,
    and vLLM's prefix-cache counters add the queried and the cached tokens. Its output
    equals the first's (greedy)."""
    before = _wait_idle(http)
    prompt = "A prompt no other test sends, long enough to fill some pages: " * 3
    bodies = [http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
        for _ in range(2)]
    n_prompt = bodies[0]["usage"]["prompt_tokens"]
    first, second = (b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    assert first == 0 and 0 < second < n_prompt and second % 16 == 0  # full pages of 16
    assert bodies[0]["choices"][0]["text"] == bodies[1]["choices"][0]["text"]
    after = _wait_idle(http)
    assert _m(after, "vllm:prefix_cache_hits_total") - _m(
        before, "vllm:prefix_cache_hits_total") == second
    assert _m(after, "vllm:prefix_cache_queries_total") - _m(
        before, "vllm:prefix_cache_queries_total") == 2 * n_prompt


def test_scheduler_metrics_follow_the_engine():
    """KV usage is the engine's fraction now; preemptions count up by the engine's
    cumulative total (vLLM's gauge and counter names)."""
    from eagle_jax.engine.types import SchedulerStats
    from eagle_jax.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.update_scheduler(SchedulerStats(3, 2, 0.625, 4))
    metrics.update_scheduler(SchedulerStats(1, 0, 0.25, 7))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(metrics.render().decode())
              for s in f.samples}
    label = (("model_name", "m"),)
    assert values[("vllm:kv_cache_usage_perc", label)] == 0.25
    assert values[("vllm:num_preemptions_total", label)] == 7
    assert values[("vllm:num_requests_running", label)] == 1
    assert values[("vllm:num_requests_waiting", label)] == 0


def test_draft_length_metrics_follow_the_engine():
    """The draft-length histogram observes each step's length once; the forecast counters
    add the policy's expected tokens and seconds since the last update."""
    from eagle_jax.engine.types import SpecDecodeStats
    from eagle_jax.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.update_spec_decode(SpecDecodeStats(draft_length_steps=[2, 0, 1, 0],
                                               forecast_tokens=10.0, forecast_seconds=0.5))
    metrics.update_spec_decode(SpecDecodeStats(draft_length_steps=[5, 1, 1, 3],
                                               forecast_tokens=25.0, forecast_seconds=1.25))
    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(metrics.render().decode())
              for s in f.samples}
    m = (("model_name", "m"),)

    def le(x):
        return tuple(sorted(m + (("le", x),)))

    name = "eagle_jax:spec_decode_draft_length_bucket"
    assert [values[(name, le(x))] for x in ("0.0", "1.0", "2.0", "3.0", "+Inf")] == [
        5, 6, 7, 10, 10]
    assert values[("eagle_jax:spec_decode_draft_length_sum", m)] == 1 + 2 + 9
    assert values[("eagle_jax:spec_decode_forecast_tokens_total", m)] == 25.0
    assert values[("eagle_jax:spec_decode_forecast_seconds_total", m)] == 1.25


def test_periodic_log_line(server):
    deadline = time.monotonic() + 5
    while "mean accept length" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "mean accept length" in server.log_text()


# ------------------------------------------------------- API key and a full queue
def test_api_key_and_queue_full(models):
    target, draft = models
    key = "sk-test-123"
    proc = ServerProcess(_engine_args(target, draft) + ["--max-queue-len", "1"],
                         env={"EAGLE_JAX_API_KEY": key})
    try:
        url = proc.base_url
        assert httpx.get(url + "/health").status_code == 200  # no key needed
        for path in ("/v1/models", "/metrics", "/tokenizer_info"):
            _assert_error(httpx.get(url + path), 401)
            _assert_error(httpx.get(url + path, headers={"Authorization": "Bearer nope"}), 401)
            assert httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}
                             ).status_code == 200
        _assert_error(httpx.post(url + "/v1/completions", json={"prompt": "a"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        name = os.path.basename(target)
        r = client.completions.create(model=name, prompt="Hi", max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3

        # 8 slots + 1 waiting: the 10th concurrent request gets 503, then all is served again.
        auth = {"Authorization": f"Bearer {key}"}
        long = {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN - 10, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
            streams = []
            try:
                for _ in range(MAX_NUM_SEQS + 1):
                    cm = c.stream("POST", "/v1/chat/completions",
                                  json={**long, "messages": MESSAGES})
                    resp = cm.__enter__()
                    streams.append(cm)
                    assert resp.status_code == 200
                    lines = resp.iter_lines()  # keep a reference: a collected iterator
                    streams.append(lines)      # closes the response
                    next(lines)  # the role chunk: the engine took the request
                err = _assert_error(c.post("/v1/completions", json={**long, "stream": False}),
                                    503)
                assert "overloaded" in err["message"]
            finally:
                for cm in streams[::2]:
                    cm.__exit__(None, None, None)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                m = _metrics(c)
                if _m(m, "vllm:num_requests_running") + _m(m, "vllm:num_requests_waiting") == 0:
                    break
                time.sleep(0.1)
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        proc.stop()


def test_missing_default_model_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """A checkout without the embedded pair: serve.py says so and exits 2."""
    import eagle_jax.assets as assets
    from eagle_jax.server import serve

    monkeypatch.setattr(assets, "DEFAULT_TARGET", str(tmp_path / "target"))
    monkeypatch.setattr(assets, "DEFAULT_DRAFT", str(tmp_path / "draft"))
    assert serve.main([]) == 2
    err = capsys.readouterr().err
    assert "embedded default model is not shipped" in err and "--model" in err


def test_precompile_logprobs_without_precompile_is_a_clear_error(monkeypatch, capsys):
    """``--precompile-logprobs`` reaches the engine's configuration, which refuses it
    beside ``--no-precompile``: serve.py prints why and exits 2 before loading anything."""
    from eagle_jax.server import serve

    def make_engine(config):
        raise AssertionError(f"serve.py went on to load an engine for {config}")

    import eagle_jax.engine

    monkeypatch.setattr(eagle_jax.engine, "make_engine", make_engine)
    assert serve.main(["--no-precompile", "--precompile-logprobs"]) == 2
    err = capsys.readouterr().err
    assert "precompile_logprobs" in err and "precompile=False" in err


# ------------------------------------------------- engine failures (in-process stub)
class _FlakyEngine:
    """Just enough of the Engine contract; ``step`` raises while ``fail`` is set."""

    def __init__(self, tokenizer):
        from eagle_jax.engine import EngineConfig
        from eagle_jax.engine.types import CompileProgress, SpecDecodeStats

        self.tokenizer = tokenizer
        self.model_name, self.max_model_len, self.vocab_size = "stub", 64, tokenizer.vocab_size
        self.config, self.num_slots = EngineConfig(model="stub", speculative_algorithm="NONE"), 4
        self.stats = SpecDecodeStats(accepted_per_pos=[0])
        self.compile_progress = CompileProgress(compiled=0, pending=0)
        self.requests, self.fail = {}, True

    def add_request(self, request_id, prompt_token_ids, params):
        self.requests[request_id] = params

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def scheduler_stats(self):
        from eagle_jax.engine.types import SchedulerStats

        return SchedulerStats(len(self.requests), 0, 0.0, 0)

    def step(self):
        from eagle_jax.engine.types import RequestOutput

        if self.fail:
            raise RuntimeError("injected engine failure")
        outs = [RequestOutput(rid, [65], True, "length", new_text="b", num_output_tokens=1)
                for rid in self.requests]
        self.requests.clear()
        return outs

    def prompt_logprobs(self, prompt_token_ids, top_n):
        raise NotImplementedError


def test_engine_step_error_fails_requests_with_500(tmp_path, caplog):
    from eagle_jax.server import create_app
    from eagle_jax.tokenizer import Tokenizer

    engine = _FlakyEngine(Tokenizer.from_dir(write_test_tokenizer(tmp_path, VOCAB)))
    app = create_app(engine)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                _assert_error(r, 500)
                assert "injected engine failure" in r.json()["error"]["message"]
                r = await c.post("/v1/completions", json={"prompt": "a", "stream": True})
                events = parse_sse(r.text)
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
                engine.fail = False  # the server keeps serving
                r = await c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "b"
                assert (await c.get("/health")).status_code == 200

    with caplog.at_level("ERROR", logger="eagle_jax.server"):
        asyncio.run(main())
    assert "injected engine failure" in caplog.text and "Traceback" in caplog.text


def test_tree_drafting_server_greedy_and_metrics(models):
    """A server drafting trees (--speculative-eagle-topk): greedy completions are the
    target's own, and /metrics counts the tree's nodes as draft tokens and acceptance
    per depth."""
    from eagle_jax import LLM
    from eagle_jax.engine import EngineConfig
    from eagle_jax.sampling import SamplingParams

    target, draft = models
    tree_nodes = 7
    proc = ServerProcess(_engine_args(target, draft) + [
        "--speculative-eagle-topk", "3", "--num-draft-tokens", str(tree_nodes + 1)])
    try:
        with httpx.Client(base_url=proc.base_url, timeout=120) as http:
            plain = LLM(EngineConfig(model=target, speculative_algorithm="NONE",
                                     max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                                     batch_buckets=(MAX_NUM_SEQS,),
                                     prefill_buckets=(PREFILL_CHUNK,), dtype="float32",
                                     precompile=False))
            prompt_ids = [http.post("/tokenize", json={"prompt": p}).json()["tokens"]
                          for p in PROMPTS]
            offline = plain.generate([list(p) for p in prompt_ids], SamplingParams(
                temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
            for p, ids, out in zip(PROMPTS, prompt_ids, offline):
                served, text, _ = _greedy(http, ids, 20, ignore_eos=True)
                assert served == list(out.token_ids), p
            r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16,
                                                   "temperature": 1.0, "seed": 3})
            assert r.status_code == 200, r.text
            after = _wait_idle(http)
    finally:
        proc.stop()
    assert "Traceback" not in proc.log_text()
    drafts = _m(after, "vllm:spec_decode_num_drafts_total")
    per_depth = [_m(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                    position=str(k)) for k in range(NUM_STEPS)]
    assert drafts > 0
    assert _m(after, "vllm:spec_decode_num_draft_tokens_total") == tree_nodes * drafts
    assert sum(per_depth) == _m(after, "vllm:spec_decode_num_accepted_tokens_total")
    assert all(a >= b for a, b in zip(per_depth, per_depth[1:]))  # a path's depths
