"""lm-evaluation-harness against the real server: its scores equal the offline engine's.

``python -m lm_eval run --model local-completions`` drives scripts/serve.py (the embedded
default pair, EAGLE-3) through two tasks stored in tests/lm_eval_tasks/: a loglikelihood
task (multiple choice) and a generate_until task. The same numbers, computed offline
through ``LLM``, must come out of every sample:

* loglikelihood: the sum of ``Engine.prompt_logprobs`` over the continuation's tokens,
  split from the context as lm-eval splits them; and whether each of those tokens is the
  argmax (lm-eval's ``is_greedy``);
* generate_until: the greedy ``LLM.generate`` text with lm-eval's stop strings (its
  ``until`` plus the tokenizer's EOS string), exactly.

lm-eval tokenizes with the target directory's own tokenizer (``tokenizer_backend=
huggingface``) and sends token ids (``tokenized_requests``, its default): the server then
scores exactly the ids whose context length lm-eval counted, so no re-tokenization of
context + continuation on the server can shift the split. Nothing is downloaded: the
tasks read local JSONL, the hub is off and HF_HOME is empty.
"""

from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from eagle_jax.assets import default_pair
from eagle_jax.testutil.server import REPO, ServerProcess

TASKS_DIR = os.path.join(REPO, "tests", "lm_eval_tasks")
CHOICE_TASK = "eagle_code_choice"
UNTIL_TASK = "eagle_code_until"
NAME = "eagle-default"
# One batch bucket and one prefill chunk keep compilation short on a CPU; the server and
# the offline LLM share these shapes (and the default S = 5 of serve.py).
MAX_NUM_SEQS = 4
PREFILL_CHUNK = 64
MAX_MODEL_LEN = 512
# Observed equal to the last bit (the same compiled scoring program; JSON and the samples
# file carry each float exactly): the tolerance only leaves room for another XLA build.
LOGLIKELIHOOD_TOL = 1e-5


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def lm_eval_run(tmp_path_factory) -> dict:
    """lm-eval's output for both tasks: {"results": {...}, "samples": {task: [sample]}}."""
    out_dir = str(tmp_path_factory.mktemp("lm_eval_out"))
    hf_home = str(tmp_path_factory.mktemp("hf_home"))
    target, _ = default_pair()
    server = ServerProcess([
        "--served-model-name", NAME, "--max-num-seqs", str(MAX_NUM_SEQS),
        "--batch-buckets", str(MAX_NUM_SEQS), "--prefill-buckets", str(PREFILL_CHUNK),
        "--max-model-len", str(MAX_MODEL_LEN)])
    try:
        model_args = ",".join([
            f"model={NAME}", f"base_url={server.base_url}/v1/completions",
            "tokenizer_backend=huggingface", f"tokenizer={target}",
            # Concurrent requests share the server's batch, as in a real evaluation.
            "num_concurrent=4", "max_retries=1", f"max_length={MAX_MODEL_LEN}"])
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", HF_HOME=hf_home)
        proc = subprocess.run(
            [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
             "--model_args", model_args, "--tasks", f"{CHOICE_TASK},{UNTIL_TASK}",
             "--include_path", TASKS_DIR, "--output_path", out_dir, "--log_samples"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    finally:
        server.stop()
    log = server.log_text()
    assert "Traceback" not in log, log[-5000:]
    (results_path,) = glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True)
    with open(results_path, encoding="utf-8") as f:
        results = json.load(f)["results"]
    samples = {}
    for task in (CHOICE_TASK, UNTIL_TASK):
        (path,) = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"),
                            recursive=True)
        samples[task] = sorted(_read_jsonl(path), key=lambda s: s["doc_id"])
    return {"results": results, "samples": samples}


@pytest.fixture(scope="module")
def llm(lm_eval_run):
    # Built after the server has stopped (lm_eval_run), so the two never share the cores.
    from eagle_jax import LLM

    target, draft = default_pair()
    return LLM(model=target, draft_model=draft, speculative_algorithm="EAGLE3",
               max_num_seqs=MAX_NUM_SEQS, batch_buckets=(MAX_NUM_SEQS,),
               prefill_buckets=(PREFILL_CHUNK,), max_model_len=MAX_MODEL_LEN,
               precompile=False)


def _arguments(sample: dict) -> list[tuple]:
    """A logged sample's request arguments in request order. The samples file writes them
    as {"gen_args_I": {"arg_0": context, "arg_1": continuation or gen_kwargs}}."""
    args = sample["arguments"]
    return [(args[f"gen_args_{i}"]["arg_0"], args[f"gen_args_{i}"]["arg_1"])
            for i in range(len(args))]


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a causal model's request: trailing whitespace of the context
    moves to the continuation; the continuation is the tail of the whole text's encoding."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def _offline_loglikelihood(engine, context: str, continuation: str) -> tuple[float, bool]:
    """(sum of the continuation tokens' logprobs, whether each is the argmax)."""
    context_ids, continuation_ids = _encode_pair(engine.tokenizer, context, continuation)
    entries = engine.prompt_logprobs(context_ids + continuation_ids, top_n=1)
    scored = entries[len(context_ids):]
    total = sum(e.logprob for e in scored)
    is_greedy = all(next(iter(e.top)) == e.token_id for e in scored)
    return total, is_greedy


def test_loglikelihood_task_equals_offline_prompt_logprobs(lm_eval_run, llm):
    samples = lm_eval_run["samples"][CHOICE_TASK]
    assert len(samples) == len(_read_jsonl(os.path.join(TASKS_DIR, "code_choice.jsonl")))
    correct = []
    for s in samples:
        scores = []
        for (context, continuation), resp in zip(_arguments(s), s["resps"]):
            # The samples file writes each (loglikelihood, is_greedy) as strings (repr).
            served_ll, served_greedy = float(resp[0][0]), resp[0][1] == "True"
            ll, is_greedy = _offline_loglikelihood(llm.engine, context, continuation)
            assert math.isclose(served_ll, ll, rel_tol=0, abs_tol=LOGLIKELIHOOD_TOL), (
                s["doc_id"], continuation, served_ll, ll)
            assert served_greedy == is_greedy, (s["doc_id"], continuation)
            scores.append(ll)
        assert len(scores) == len(s["doc"]["choices"])
        acc = float(max(range(len(scores)), key=scores.__getitem__) == s["doc"]["gold"])
        assert s["acc"] == acc, s["doc_id"]
        correct.append(acc)
    assert lm_eval_run["results"][CHOICE_TASK]["acc,none"] == pytest.approx(
        sum(correct) / len(correct))


def test_generate_until_task_equals_offline_greedy(lm_eval_run, llm):
    from eagle_jax import SamplingParams

    samples = lm_eval_run["samples"][UNTIL_TASK]
    assert len(samples) == len(_read_jsonl(os.path.join(TASKS_DIR, "code_until.jsonl")))
    eos = llm.tokenizer.decode([llm.engine.model_config.eos_token_ids[0]],
                               skip_special_tokens=False)
    contexts, params = [], []
    for s in samples:
        ((context, gen_kwargs),) = _arguments(s)
        contexts.append(llm.tokenizer.encode(context, add_special_tokens=False))
        params.append(SamplingParams(temperature=0.0, max_tokens=gen_kwargs["max_gen_toks"],
                                     stop=tuple(gen_kwargs["until"]) + (eos,)))
    offline = llm.generate(contexts, params, use_tqdm=False)
    matches = []
    for s, out in zip(samples, offline):
        assert s["resps"] == [[out.text]], s["doc_id"]
        matches.append(float(out.text == s["target"]))
        assert s["exact_match"] == matches[-1], s["doc_id"]
    # Not every line is the target's (the model is small); at least one is, so the
    # comparison covers a scored match and a miss.
    assert 0 < sum(matches) < len(matches)
    assert lm_eval_run["results"][UNTIL_TASK]["exact_match,none"] == pytest.approx(
        sum(matches) / len(matches))
