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


PROMPTS = [[5, 17, 33, 2, 9, 41, 7], list(range(40, 61)), [300, 12, 12, 12, 99]]


@pytest.fixture(scope="module")
def plain_fp8_greedy(pair):
    return _greedy(_engine(pair, "NONE", kv_cache_dtype="fp8"), PROMPTS)


@pytest.mark.parametrize("drafting", [
    {}, dict(speculative_eagle_topk=2, num_draft_tokens=6, tree_verify="traversal")])
def test_speculative_greedy_over_an_fp8_cache_is_the_targets(pair, plain_fp8_greedy,
                                                              drafting):
    """EAGLE-3 greedy over an FP8 cache, chain and tree (whose accepted path's keys and
    values move through the e4m3 pool), equals plain greedy over an FP8 cache: the target
    reads the same e4m3 keys and values either way."""
    assert _greedy(_engine(pair, kv_cache_dtype="fp8", **drafting), PROMPTS) == plain_fp8_greedy


def test_an_fp8_cache_moves_the_logits_by_e4m3s_rounding(pair):
    """The target's forward over an FP8 cache against a float32 one, 8 prompts of 32
    tokens written and read through the pool: e4m3's 3 mantissa bits (relative steps of
    at most 1/16) move this tiny target's logits by ~5% rms; the test allows 10% and
    asks 80% of the 256 argmaxes to stay (~4 standard deviations of the agreement below
    the measured mean, printed). Values read back wrong (a lost saturation, an unwidened
    tile) move the logits by their own size."""
    from eagle_jax.models.decoder import load_decoder

    model = load_decoder(pair[0], "float32")
    rng = np.random.default_rng(8)
    tokens = jnp.asarray(rng.integers(0, 320, (8, 32)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(32), (8, 32))
    logits = {dtype: np.asarray(model(tokens, positions, model.init_cache(8, 32, dtype)).logits)
              for dtype in (jnp.float32, KV_FP8)}
    ref, out = logits[jnp.float32], logits[KV_FP8]
    err = float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2)))
    agree = float(np.mean(out.argmax(-1) == ref.argmax(-1)))
    print(f"\nFP8 cache vs float32: rms logit error {err:.3f}, argmax agreement {agree:.3f}")
    assert 0 < err < 0.1 and agree >= 0.8


def test_a_bad_kv_cache_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\)"):
        EngineConfig(model="default", speculative_algorithm="NONE", kv_cache_dtype="int8")
