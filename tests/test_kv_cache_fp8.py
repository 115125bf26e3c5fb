"""An FP8 KV cache (``EngineConfig.kv_cache_dtype="fp8"``, issue 63): e4m3 pools for the
target and the draft, saturated writes, twice the positions of bfloat16 in the same
memory, and speculation exact against the target over the same cache."""

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import SamplingParams
from eagle_jax.engine import LLM, Engine, EngineConfig
from eagle_jax.kernels.paged_attention import KV_FP8
from eagle_jax.models.layers import KVPages


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from eagle_jax.testutil.drafts import write_tiny_eagle3_draft
    from eagle_jax.testutil.models import write_tiny_target

    root = tmp_path_factory.mktemp("fp8_kv")
    target = write_tiny_target(str(root / "t"), "llama", vocab_size=320)
    return target, write_tiny_eagle3_draft(str(root / "d"), target, draft_vocab_size=200)


def _engine(pair, algorithm="EAGLE3", **kw):
    target, draft = pair
    config = dict(model=target, speculative_algorithm=algorithm, dtype="float32",
                  max_model_len=96, max_num_seqs=4, batch_buckets=(4,), prefill_buckets=(32,),
                  compilation_cache_dir="", precompile=False, num_steps=3)
    if algorithm != "NONE":
        config["draft_model"] = draft
    return Engine(EngineConfig(**{**config, **kw}))


def _greedy(engine, prompts, max_tokens=24):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in LLM(engine=engine).generate(prompts, params, use_tqdm=False)]


def test_writes_saturate_and_round_to_e4m3():
    """A write to an FP8 pool clips to +-448 (e4m3fn has no infinity: a plain cast of
    1000 would be NaN) and rounds to e4m3's grid; a padding slot past the pool is
    dropped."""
    pages = KVPages.zeros(1, 2, 4, 1, 2, KV_FP8)
    k = jnp.asarray([[[[1000.0, -1000.0]], [[3.3, -0.0136]]]])  # [B=1, T=2, K=1, D=2]
    pages = pages.write(0, k, -k, jnp.asarray([[5, 8]]))  # slot 8: past the 2 x 4 rows
    got = np.asarray(pages.k[0].astype(jnp.float32)).reshape(8, 2)
    np.testing.assert_array_equal(got[5], [448.0, -448.0])
    assert np.all(got[[0, 1, 2, 3, 4, 6, 7]] == 0)
    np.testing.assert_array_equal(np.asarray(pages.v[0].astype(jnp.float32)).reshape(8, 2)[5],
                                  [-448.0, 448.0])
    assert pages.k[0].dtype == KV_FP8
    np.testing.assert_array_equal(np.asarray(jnp.asarray([3.3, -0.0136], KV_FP8), np.float32),
                                  [3.25, -0.013671875])


def test_an_fp8_cache_holds_more_positions_in_the_same_memory(pair):
    """The same kv_cache_memory holds 4x the pages of a float32 cache (1 byte against 4
    per value), both models' pools e4m3. (Without prefix caching: its per-page share of
    the target feature stays in the model's dtype.)"""
    sized = dict(enable_prefix_caching=False, max_model_len=None)
    budget = _engine(pair, enable_prefix_caching=False).kv_bytes
    f32 = _engine(pair, kv_cache_memory=budget, **sized)
    fp8 = _engine(pair, kv_cache_memory=budget, kv_cache_dtype="fp8", **sized)
    assert 4 * f32.num_pages <= fp8.num_pages < 4 * (f32.num_pages + 1), (
        fp8.num_pages, f32.num_pages)
    state = fp8.runner.state
    assert state.target_pages.k[0].dtype == KV_FP8 and state.draft_pages.v[0].dtype == KV_FP8
    assert f32.runner.state.target_pages.k[0].dtype == jnp.float32
    assert fp8.kv_bytes <= budget


def test_speculative_greedy_over_an_fp8_cache_is_the_targets(pair):
    """EAGLE-3 greedy over an FP8 cache equals plain greedy over an FP8 cache (the target
    reads the same e4m3 keys and values either way); against a float32 cache, how much
    agrees is printed (e4m3 moves the logits by a few percent)."""
    prompts = [[5, 17, 33, 2, 9, 41, 7], list(range(40, 61)), [300, 12, 12, 12, 99]]
    spec = _greedy(_engine(pair, kv_cache_dtype="fp8"), prompts)
    plain = _greedy(_engine(pair, "NONE", kv_cache_dtype="fp8"), prompts)
    assert spec == plain
    exact = _greedy(_engine(pair, "NONE"), prompts)
    same = [int(np.sum(np.cumprod(np.equal(a, b)))) for a, b in zip(plain, exact)]
    print(f"\nFP8 cache vs float32 cache, greedy: identical prefixes {same} of 24 tokens")


def test_a_bad_kv_cache_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\)"):
        EngineConfig(model="default", speculative_algorithm="NONE", kv_cache_dtype="int8")
