"""The shipped default pair: a real code model and its EAGLE-3 draft (issue 8).

Greedy speculative output equals greedy target output on held-out prompts (files the
target and draft never trained on), and the draft is good enough that the accept length
on them exceeds 3. The tools run on the pair with no model argument.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from eagle_jax import SamplingParams
from eagle_jax.assets import DEFAULT_DIR, DEFAULT_DRAFT, DEFAULT_TARGET, default_pair
from eagle_jax.engine import LLM, EngineConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=(4,),
             prefill_buckets=(128,), compilation_cache_dir="")


def _heldout_prompts():
    with open(os.path.join(DEFAULT_DIR, "heldout_prompts.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_pair_is_shipped_within_its_size_limit():
    target, draft = default_pair()
    sizes = {}
    for d in (target, draft):
        for name in os.listdir(d):
            if name.endswith(".safetensors"):
                size = os.path.getsize(os.path.join(d, name))
                assert size <= 15 * 10**6, (name, size)
                sizes[os.path.join(d, name)] = size
    assert sum(sizes.values()) <= 40 * 10**6
    heldout = set(open(os.path.join(DEFAULT_DIR, "corpus", "heldout_files.txt")).read().split())
    train = set(open(os.path.join(DEFAULT_DIR, "corpus", "train_files.txt")).read().split())
    assert heldout and train and not heldout & train
    assert {p["source"] for p in _heldout_prompts()} <= heldout


def test_greedy_speculative_equals_target_and_accepts_more_than_3():
    prompts = [p["prompt"] for p in _heldout_prompts()[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = LLM(EngineConfig(model=DEFAULT_TARGET, speculative_algorithm="NONE", **SMALL))
    spec = LLM(EngineConfig(model=DEFAULT_TARGET, draft_model=DEFAULT_DRAFT,
                            speculative_algorithm="EAGLE3", num_steps=5, **SMALL))
    ref = plain.generate(prompts, params, use_tqdm=False)
    out = spec.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    stats = spec.engine.stats
    assert stats.num_invalid_tokens == 0
    assert stats.mean_accept_length > 3.0, stats


def test_evaluate_runs_on_the_default_pair(tmp_path):
    report = tmp_path / "eval.json"
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "evaluate.py"), "--dataset",
         os.path.join(DEFAULT_DIR, "heldout_prompts.jsonl"), "--limit", "2", "--max-tokens",
         "16", "--num-steps", "5", "--temperature", "0", "--batch-size", "2",
         "--max-model-len", "256", "--dtype", "float32", "--batch-buckets", "2",
         "--prefill-buckets", "128", "--json", str(report), "--no-progress"],
        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = json.loads(report.read_text())
    assert "S=5" in r.stdout and runs


def test_serve_uses_the_default_pair():
    import httpx

    from eagle_jax.testutil.server import ServerProcess

    server = ServerProcess(["--max-num-seqs", "2", "--batch-buckets", "2",
                            "--prefill-buckets", "128", "--max-model-len", "256",
                            "--dtype", "float32"])
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            models = c.get("/v1/models").json()["data"]
            assert models[0]["id"] == "target" and models[0]["max_model_len"] == 256
            r = c.post("/v1/completions", json={"prompt": "def fibonacci(n):",
                                                "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()
