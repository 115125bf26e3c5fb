"""Random-weight models of real shapes, for the benchmarks and tests: a Llama-shaped
target (``random_target``, optionally built sharded for tensor parallelism) and an
EAGLE-3-shaped draft over it (``random_eagle3``). ``LLAMA_8B``: the Llama-3.1-8B shape;
``SMALL``: tiny shapes for a CPU smoke run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax import parallel
from eagle_jax.config import ModelConfig, RopeScaling
from eagle_jax.models.decoder import Decoder
from eagle_jax.models.draft import new_draft
from eagle_jax.models.draft_config import EAGLE3, DraftConfig
from eagle_jax.params import module_param_paths

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128)
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=4,
             num_heads=4, num_kv_heads=2, head_dim=64)


def random_target(shape: dict, dtype, mesh=None) -> Decoder:
    """A Llama-shaped target of random weights. With ``mesh`` (``parallel.make_mesh``), built
    for tensor parallelism over it, each parameter created with its sharding: no device
    ever holds a whole model that one device could not."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
                      max_position_embeddings=131072, eos_token_ids=(), **shape)
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, mesh=mesh, rngs=nnx.Rngs(0)))
    shardings = parallel.param_shardings(model, mesh) if mesh is not None else {}
    fills = {}  # one jitted fill per (sharding, ones)

    def fill(key, shape, sharding, ones):
        if (sharding, ones) not in fills:
            placed = {} if sharding is None else dict(out_shardings=sharding)
            fills[(sharding, ones)] = jax.jit(
                lambda key, shape: (jnp.ones(shape, dtype) if ones else (
                    jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)),
                static_argnums=1, **placed)
        return fills[(sharding, ones)](key, shape)

    for i, (path, var) in enumerate(module_param_paths(model)):
        var.set_value(fill(jax.random.PRNGKey(i), tuple(var.shape), shardings.get(path),
                           "norm" in str(path)))
    return model



def random_eagle3(target: Decoder, dtype, draft_vocab: int) -> object:
    t = target.config
    hf = dict(architectures=["LlamaForCausalLMEagle3"], hidden_size=t.hidden_size,
              intermediate_size=t.intermediate_size, num_attention_heads=t.num_heads,
              num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, num_hidden_layers=1,
              vocab_size=t.vocab_size, draft_vocab_size=draft_vocab, rms_norm_eps=1e-5,
              rope_theta=t.rope_theta, max_position_embeddings=t.max_position_embeddings)
    cfg = DraftConfig.from_hf_dict(hf, EAGLE3, t, "bench")
    d2t = jnp.asarray(np.sort(np.random.default_rng(0).choice(t.vocab_size, draft_vocab, False))
                      - np.arange(draft_vocab), jnp.int32)
    return new_draft(cfg, target_embed=target.embed_tokens.weight[...],
                     target_lm_head=target.lm_head_weight, d2t=d2t, dtype=dtype)
