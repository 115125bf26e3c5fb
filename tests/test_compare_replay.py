"""scripts/compare_replay.py: the jitted (XLA) and op-by-op paths agree on a tiny model
and the tool exits 0; a perturbed jitted step makes it exit non-zero."""

from __future__ import annotations

import json

import pytest

from eagle_jax.compare import compare_replay as cr


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target
    from eagle_jax.testutil.tokenizer import write_test_tokenizer

    root = tmp_path_factory.mktemp("compare")
    target = write_tiny_target(str(root / "target"), "llama", vocab_size=320, hidden_size=32,
                               num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64,
                               max_position_embeddings=128, eos_token_id=2, init_std=0.05)
    write_test_tokenizer(target, vocab_size=300)
    draft = write_tiny_eagle3_draft(str(root / "draft"), target, init_std=0.05)
    return dict(target=target, draft=draft)


def _argv(pair, out, *extra):
    return ["--model", pair["target"], "--draft-model", pair["draft"], "--num-steps", "2",
            "--num-prompts", "4", "--prompt-len", "10", "--max-tokens", "12",
            "--batch-size", "4", "--batch-buckets", "4", "--prefill-buckets", "16",
            "--max-model-len", "48", "--compilation-cache-dir", "", "--modes", "xla,eager",
            "--json", str(out), *extra]


def test_xla_and_op_by_op_agree(pair, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cr.main(_argv(pair, out)) == 0
    rep = json.loads(out.read_text())
    xla, eager = rep["modes"]
    assert (xla["mode"], eager["mode"]) == ("xla", "eager")
    agree = rep["agreement"]
    assert agree["greedy"]["identical"] == agree["greedy"]["requests"] == 2
    assert agree["sampled"]["token_agreement"] >= rep["min_agreement"]
    assert rep["failures"] == []
    for m in (xla, eager):
        assert m["tokens_ge_vocab"] == 0 and m["sampler_fallbacks"] == 0
        assert m["nonfinite_draft_probs"] == 0 and m["malformed_draft_probs"] == 0
        assert m["num_output_tokens"] == 4 * 12
    # Same tokens and same random draws: the per-step accept lengths agree as well.
    assert xla["mean_accept_length"] == eager["mean_accept_length"]
    assert xla["acceptance_per_position"] == eager["acceptance_per_position"]
    assert rep["tokens"]["xla"] == rep["tokens"]["eager"]
    assert "PASS" in capsys.readouterr().out


def test_perturbed_jitted_step_fails(pair, tmp_path, capsys):
    out = tmp_path / "report.json"
    # (Fewer tokens than the agreeing run: a perturbed step diverges from the first.)
    assert cr.main(_argv(pair, out, "--perturb", "--max-tokens", "6")) == 1
    rep = json.loads(out.read_text())
    assert rep["config"]["perturb"] == "weight-noise"
    assert rep["agreement"]["greedy"]["identical"] < rep["agreement"]["greedy"]["requests"]
    assert rep["failures"]
    assert "FAIL" in capsys.readouterr().out


def test_torch_replay_mode_skips_without_gpu_or_reproduces_004():
    import torch
    from eagle_jax.compare.torch_replay import run_torch_replay

    res = run_torch_replay(batch=4, num_steps=3, vocab_size=300, width=320, steps=4)
    if not torch.cuda.is_available():
        assert res["status"] == "skipped: no torch GPU"
    # The same stages with the recycling made explicit (no GPU needed): the unfixed run
    # reads -inf draft probabilities, falls back and emits ids past the vocabulary; the
    # copy-out fix with the guarded sampler is clean.
    emu = run_torch_replay(batch=4, num_steps=3, vocab_size=300, width=320, steps=16,
                           emulate=True)
    assert emu["failure_reproduced"] and emu["fix_clean"]
    bad = emu["variants"]["no copy-out, unguarded sampler"]
    assert bad["nonfinite_draft_probs"] > 0 and bad["tokens_ge_vocab"] > 0
    guarded = emu["variants"]["no copy-out, guarded sampler"]
    assert guarded["tokens_ge_vocab"] == 0  # the guard alone keeps ids valid
    assert emu["variants"]["copy-out, unguarded sampler"]["nonfinite_draft_probs"] == 0
