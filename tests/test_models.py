"""Target decoder parity against transformers, and the KV-cache forward modes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from eagle_jax.models.decoder import load_decoder

ARCHS = ["llama", "llama3", "llama_tied", "qwen2", "qwen3"]


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _cache(model, batch, max_len, dtype=jnp.float32):
    return model.init_cache(batch, max_len, dtype)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_targets, arch):
    model_dir = tiny_targets(arch)
    model = load_decoder(model_dir, "float32")
    rng = np.random.default_rng(hash(arch) % 2**32)
    tokens = rng.integers(0, 256, (2, 37))
    with torch.no_grad():
        ref = _hf(model_dir)(torch.tensor(tokens)).logits.numpy()
    # A padded bucket: 48 columns, the last 11 padding (positions past the cache).
    padded = np.zeros((2, 48), np.int32)
    padded[:, :37] = tokens
    positions = np.where(np.arange(48) < 37, np.arange(48), 1 << 30)[None].repeat(2, 0)
    out = model(jnp.asarray(padded), jnp.asarray(positions), _cache(model, 2, 64))
    # Without a cache (training, scoring): causal attention over the tokens themselves.
    no_cache = model(jnp.asarray(tokens), jnp.arange(37)[None].repeat(2, 0), None)
    for got in (np.asarray(out.logits)[:, :37], np.asarray(no_cache.logits)):
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel < 1e-4, rel
        assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_decode_and_verify_through_cache_equal_full_forward(tiny_targets, arch):
    model = load_decoder(tiny_targets(arch), "float32")
    rng = np.random.default_rng(7)
    lengths = np.array([9, 14])  # per-request prompt lengths
    total = 24
    tokens = jnp.asarray(rng.integers(0, 256, (2, total)))
    full = np.asarray(model(tokens, jnp.arange(total)[None].repeat(2, 0),
                            _cache(model, 2, 32)).logits)

    # Prefill each request's prompt (padded), then decode one token at a time.
    pos = np.where(np.arange(total)[None] < lengths[:, None], np.arange(total)[None], 1 << 30)
    cache = model(tokens, jnp.asarray(pos), _cache(model, 2, 32)).cache
    for step in range(6):
        p = lengths + step
        out = model(tokens[np.arange(2), p][:, None], jnp.asarray(p)[:, None], cache)
        cache = out.cache
        for b in range(2):
            np.testing.assert_allclose(np.asarray(out.logits)[b, 0], full[b, p[b]],
                                       rtol=1e-4, atol=1e-4)
    # Verify forward: k tokens per request at per-request positions in one call.
    k = 4
    start = lengths + 6
    vpos = start[:, None] + np.arange(k)
    vtok = np.take_along_axis(np.asarray(tokens), vpos, 1)
    out = model(jnp.asarray(vtok), jnp.asarray(vpos), cache,
                logit_rows=jnp.asarray([[0, 3, 1], [2, 2, 0]]))
    for b, rows in enumerate([[0, 3, 1], [2, 2, 0]]):
        np.testing.assert_allclose(np.asarray(out.logits)[b], full[b, vpos[b, rows]],
                                   rtol=1e-4, atol=1e-4)


def test_aux_hidden_states_are_layer_inputs(tiny_targets):
    model_dir = tiny_targets("llama")
    model = load_decoder(model_dir, "float32")
    tokens = np.random.default_rng(3).integers(0, 256, (1, 12))
    layers = model.config.eagle3_aux_layers
    out = model(jnp.asarray(tokens), jnp.arange(12)[None], _cache(model, 1, 16), aux_layers=layers)
    with torch.no_grad():
        hs = _hf(model_dir)(torch.tensor(tokens), output_hidden_states=True).hidden_states
    ref = np.concatenate([hs[i].numpy() for i in layers], -1)  # hidden_states[i] = input of layer i
    np.testing.assert_allclose(np.asarray(out.aux_hidden), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.hidden), hs[-1].numpy(), rtol=1e-4, atol=1e-5)


def test_bfloat16_tracks_float32(tiny_targets):
    model_dir = tiny_targets("qwen2")
    f32 = load_decoder(model_dir, "float32")
    bf16 = load_decoder(model_dir, "bfloat16")
    assert bf16.embed_tokens.weight.dtype == jnp.bfloat16
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (1, 16)))
    pos = jnp.arange(16)[None]
    a = np.asarray(f32(tokens, pos, _cache(f32, 1, 16)).logits)
    b = np.asarray(bf16(tokens, pos, _cache(bf16, 1, 16, jnp.bfloat16)).logits)
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 3e-2


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_greedy_generate_matches_transformers(tiny_targets, arch):
    from eagle_jax import LLM, SamplingParams
    from eagle_jax.engine import EngineConfig

    model_dir = tiny_targets(arch)
    llm = LLM(EngineConfig(model=model_dir, speculative_algorithm="NONE", dtype="float32",
                           max_model_len=96, max_num_seqs=4, batch_buckets=(4,),
                           prefill_buckets=(32,), compilation_cache_dir=""))
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, 256, n)] for n in (3, 20, 45)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    hf = _hf(model_dir)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"
