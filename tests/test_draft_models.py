"""EAGLE-1 / EAGLE-3 draft models: forward vs an independent reference, the one-row LM
head of draft extend (seed 000), and the draft never running target code (seed 003)."""

from __future__ import annotations

import ast
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.checkpoint import CheckpointReader
from eagle_jax.models import draft as draft_mod
from eagle_jax.models import draft_ops
from eagle_jax.models.decoder import Decoder, DecoderLayer, load_decoder
from eagle_jax.models.draft import Eagle1Draft, Eagle3Draft
from eagle_jax.models.draft_checkpoint import load_draft
from eagle_jax.testutil.drafts import write_tiny_eagle1_draft, write_tiny_eagle3_draft
from eagle_jax.testutil.models import write_tiny_target

B, T, MAX_LEN = 2, 7, 32
LENGTHS = np.array([7, 4])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    target = write_tiny_target(str(root / "target"))
    return dict(
        target=target,
        e3=write_tiny_eagle3_draft(str(root / "e3"), target, draft_vocab_size=100, seed=1),
        e3_nbr=write_tiny_eagle3_draft(str(root / "e3_nbr"), target, seed=2,
                                       norm_before_residual=True, aux_layer_ids=[0, 1, 2]),
        e1=write_tiny_eagle1_draft(str(root / "e1"), target, seed=3),
    )


@pytest.fixture(scope="module")
def target(dirs):
    return load_decoder(dirs["target"])


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (B, T)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T), (B, T)).copy()
    pos[np.arange(T)[None, :] >= LENGTHS[:, None]] = 10**6  # padding: KV write dropped
    return jnp.asarray(tokens), jnp.asarray(pos, jnp.int32)


def _features(target, draft, tokens, positions):
    out = target(tokens, positions, target.init_cache(B, MAX_LEN),
                 aux_layers=draft.feature_layers or ())
    return out.aux_hidden if draft.kind == "EAGLE3" else out.hidden


# ------------------------------------------------------------ independent reference


def _np(reader, name):
    return np.asarray(reader.get(name), np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv  # [T, D/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _attention(x, w, prefix, cfg):
    """Full causal self-attention over one sequence x [T, in] (no cache)."""
    n, k, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t = x.shape[0]
    pos = np.arange(t, dtype=np.float64)
    q = _rope((x @ w[f"{prefix}.q_proj.weight"].T).reshape(t, n, d), pos, cfg["rope_theta"])
    kk = _rope((x @ w[f"{prefix}.k_proj.weight"].T).reshape(t, k, d), pos, cfg["rope_theta"])
    v = (x @ w[f"{prefix}.v_proj.weight"].T).reshape(t, k, d)
    out = np.zeros((t, n, d))
    for head in range(n):
        g = head // (n // k)
        s = q[:, head] @ kk[:, g].T / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
    return out.reshape(t, n * d) @ w[f"{prefix}.o_proj.weight"].T


def _mlp(x, w, prefix):
    g = x @ w[f"{prefix}.gate_proj.weight"].T
    return (g / (1 + np.exp(-g)) * (x @ w[f"{prefix}.up_proj.weight"].T)) @ w[
        f"{prefix}.down_proj.weight"].T


def reference_eagle3(draft_dir, target_dir, tokens, hidden_rows, cfg, norm_before_residual):
    """The published EAGLE-3 architecture, written out: one sequence, hidden_rows [T, H]
    already projected. Returns (hidden_out [T, H], logits [T, Vd])."""
    r = CheckpointReader(draft_dir)
    w = {n: _np(r, n) for n in r.keys() if n not in ("d2t", "t2d")}
    embed = _np(CheckpointReader(target_dir), "model.embed_tokens.weight")
    eps = cfg["rms_norm_eps"]
    h = hidden_rows
    hn = _rms(h, w["midlayer.hidden_norm.weight"], eps)
    x = np.concatenate([_rms(embed[tokens], w["midlayer.input_layernorm.weight"], eps), hn], -1)
    residual = hn if norm_before_residual else h
    h = residual + _attention(x, w, "midlayer.self_attn", cfg)
    h = h + _mlp(_rms(h, w["midlayer.post_attention_layernorm.weight"], eps), w, "midlayer.mlp")
    logits = _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    return h, logits


def reference_eagle1(draft_dir, target_dir, tokens, hidden_rows, cfg):
    """The published EAGLE-1 architecture: fc(cat(embed, hidden)) + one Llama layer with
    no input_layernorm; logits through the target's LM head, no final norm."""
    r = CheckpointReader(draft_dir)
    w = {n: _np(r, n) for n in r.keys()}
    tr = CheckpointReader(target_dir)
    x = np.concatenate([w["embed_tokens.weight"][tokens], hidden_rows], -1)
    x = x @ w["fc.weight"].T + w["fc.bias"]
    x = x + _attention(x, w, "layers.0.self_attn", cfg)
    x = x + _mlp(_rms(x, w["layers.0.post_attention_layernorm.weight"], cfg["rms_norm_eps"]),
                 w, "layers.0.mlp")
    return x, x @ _np(tr, "lm_head.weight").T


def _cfg(path):
    import json
    import os
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("which", ["e3", "e3_nbr", "e1"])
def test_forward_matches_independent_reference(dirs, target, which):
    """Prefill over a padded batch, then one decode step, vs the written-out architecture."""
    draft = load_draft(dirs[which], target)
    cfg = _cfg(dirs[which])
    tokens, pos = _inputs()
    feats = _features(target, draft, tokens, pos)
    hidden = draft.project(feats)
    out, cache = draft(tokens, hidden, pos, draft.init_cache(B, MAX_LEN))
    logits = draft.logits(out)
    # decode one more row per request, fed back the last row's hidden_out
    nxt = jnp.asarray([3, 5], jnp.int32)
    last = jnp.asarray(LENGTHS - 1)
    h_last = out[jnp.arange(B), last]
    dec_logits, dec_h, _ = draft_ops.draft_decode_step(draft, nxt, h_last, jnp.asarray(LENGTHS),
                                                      cache)
    for b in range(B):
        n = LENGTHS[b]
        toks = np.concatenate([np.asarray(tokens[b, :n]), [int(nxt[b])]])
        rows = np.concatenate([np.asarray(hidden[b, :n], np.float64),
                               np.asarray(h_last[b], np.float64)[None]])
        if which == "e1":
            ref_h, ref_l = reference_eagle1(dirs[which], dirs["target"], toks, rows, cfg)
        else:
            ref_h, ref_l = reference_eagle3(dirs[which], dirs["target"], toks, rows, cfg,
                                            which == "e3_nbr")
        np.testing.assert_allclose(out[b, :n], ref_h[:n], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(logits[b, :n], ref_l[:n], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(dec_h[b], ref_h[n], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(dec_logits[b], ref_l[n], rtol=2e-4, atol=2e-4)


def test_eagle3_projection_is_fc_over_aux_layers(dirs, target):
    draft = load_draft(dirs["e3"], target)
    assert draft.kind == "EAGLE3" and draft.feature_layers == target.config.eagle3_aux_layers
    feats = jnp.ones((3, 3 * 64))
    w = np.asarray(CheckpointReader(dirs["e3"]).get("fc.weight"))
    np.testing.assert_allclose(draft.project(feats), np.ones((3, 192)) @ w.T, rtol=1e-5, atol=1e-5)
    e1 = load_draft(dirs["e1"], target)
    assert e1.kind == "EAGLE" and e1.feature_layers is None and e1.d2t is None
    np.testing.assert_array_equal(e1.project(feats[:, :64]), feats[:, :64])


@pytest.mark.parametrize("which", ["e3", "e1"])
def test_select_logits_one_row_per_request(dirs, target, which, monkeypatch):
    """select_logits == logits at the rows, and the LM head kernel gets B rows (000)."""
    draft = load_draft(dirs[which], target)
    tokens, pos = _inputs(1)
    feats = _features(target, draft, tokens, pos)
    rows = jnp.asarray([5, 2], jnp.int32)
    calls = []
    real = draft_mod.gathered_lm_head

    def spy(hidden, row_indices, weight, **kw):
        out = real(hidden, row_indices, weight, **kw)
        calls.append((hidden.shape, row_indices.shape, out.shape))
        return out

    monkeypatch.setattr(draft_mod, "gathered_lm_head", spy)
    res = draft_ops.draft_extend(draft, tokens, tokens[:, -1], rows + 1, feats, pos,
                                 draft.init_cache(B, MAX_LEN))
    vd = draft.draft_vocab_size
    assert res.logits.shape == (B, vd) and res.hidden_all.shape == (B, T, 64)
    full = draft.logits(res.hidden_all)
    np.testing.assert_allclose(res.logits, full[jnp.arange(B), rows], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(res.hidden, res.hidden_all[jnp.arange(B), rows])
    assert len(calls) == 1
    _, idx_shape, out_shape = calls[0]
    assert idx_shape == (B,) and out_shape == (B, vd)
    if which == "e3":  # the final norm ran on the B gathered rows only
        assert calls[0][0] == (B, 64)


@pytest.mark.parametrize("which", ["e3", "e1"])
def test_extend_graph_projects_only_b_rows(dirs, target, which):
    """In the compiled extend (jnp path), every V-wide matmul has exactly B rows."""
    draft = load_draft(dirs[which], target, use_kernels=False)
    tokens, pos = _inputs(2)
    feats = _features(target, draft, tokens, pos)
    rows = jnp.asarray([1, 3], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda f: draft_ops.draft_extend(
        draft, tokens, tokens[:, -1], rows + 1, f, pos, draft.init_cache(B, MAX_LEN)).logits)(feats)
    vd = draft.draft_vocab_size
    head = np.asarray(draft.lm_head_weight())
    head_vars = {v for v, c in zip(jaxpr.jaxpr.constvars, jaxpr.consts)
                 if np.shape(c) == head.shape and np.array_equal(np.asarray(c), head)}
    through_head = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"
                    and any(v in head_vars for v in e.invars)]
    assert through_head and all(e.outvars[0].aval.shape == (B, vd) for e in through_head)


def test_kernel_and_jnp_paths_agree(dirs, target):
    tokens, pos = _inputs(3)
    a = load_draft(dirs["e3"], target)
    b = load_draft(dirs["e3"], target, use_kernels=False)
    feats = _features(target, a, tokens, pos)
    rows = jnp.asarray([6, 3], jnp.int32)
    ra = draft_ops.draft_extend(a, tokens, tokens[:, -1], rows + 1, feats, pos,
                                a.init_cache(B, MAX_LEN))
    rb = draft_ops.draft_extend(b, tokens, tokens[:, -1], rows + 1, feats, pos,
                                b.init_cache(B, MAX_LEN))
    np.testing.assert_allclose(ra.logits, rb.logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ra.hidden_all, rb.hidden_all, rtol=1e-5, atol=1e-5)


def test_extend_window_equals_sequential_steps(dirs, target):
    """A multi-row extend writes the same cache and hidden states as row-by-row steps."""
    draft = load_draft(dirs["e3"], target)
    rng = np.random.default_rng(4)
    tokens = jnp.asarray(rng.integers(0, 256, (B, 3)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((B, 3, 64)), jnp.float32)
    pos = jnp.asarray([[4, 5, 6], [2, 3, 4]], jnp.int32)
    cache0 = draft.init_cache(B, MAX_LEN)
    warm_tok, warm_pos = _inputs(5)
    _, cache0 = draft(warm_tok, jnp.ones((B, T, 64)), warm_pos, cache0)
    out, cache = draft(tokens, hidden, pos, cache0)
    c = cache0
    for j in range(3):
        o, c = draft(tokens[:, j:j + 1], hidden[:, j:j + 1], pos[:, j:j + 1], c)
        np.testing.assert_allclose(out[:, j], o[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.pages.k[0], c.pages.k[0], rtol=1e-6, atol=1e-6)


def test_shift_tokens():
    tokens = jnp.asarray([[10, 11, 12, 13], [20, 21, 0, 0]], jnp.int32)
    out = draft_ops.shift_tokens(tokens, jnp.asarray([4, 2]), jnp.asarray([99, 98]))
    np.testing.assert_array_equal(out, [[11, 12, 13, 99], [21, 98, 0, 0]])


def test_extend_row_is_last_window_position(dirs, target):
    draft = load_draft(dirs["e3"], target)
    tokens, pos = _inputs(6)
    feats = _features(target, draft, tokens, pos)
    nxt = jnp.asarray([7, 8], jnp.int32)
    res = draft_ops.draft_extend(draft, tokens, nxt, jnp.asarray(LENGTHS), feats, pos,
                                 draft.init_cache(B, MAX_LEN))
    shifted = draft_ops.shift_tokens(tokens, jnp.asarray(LENGTHS), nxt)
    out, _ = draft(shifted, draft.project(feats), pos, draft.init_cache(B, MAX_LEN))
    np.testing.assert_allclose(res.hidden, out[jnp.arange(B), LENGTHS - 1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["e3", "e1"])
def test_draft_never_runs_target_code(dirs, target, which, monkeypatch):
    """Seed 003: with every target-only entry point booby-trapped, the draft's prefill,
    extend and decode (eager and jitted) still run."""
    draft = load_draft(dirs[which], target)
    tokens, pos = _inputs(7)
    feats = _features(target, draft, tokens, pos)  # the TARGET's forward, before the trap

    def trap(*a, **k):
        raise AssertionError("a draft entered target-only code")

    monkeypatch.setattr(Decoder, "__call__", trap)
    monkeypatch.setattr(Decoder, "logits", trap)
    monkeypatch.setattr(Decoder, "init_cache", trap)
    monkeypatch.setattr(DecoderLayer, "__call__", trap)

    def prefill_and_decode(feats):
        res = draft_ops.draft_extend(draft, tokens, jnp.asarray([1, 2]), jnp.asarray(LENGTHS),
                                     feats, pos, draft.init_cache(B, MAX_LEN))
        return draft_ops.draft_decode_step(draft, jnp.argmax(res.logits, -1), res.hidden,
                                           jnp.asarray(LENGTHS), res.cache)[0]

    eager = prefill_and_decode(feats)
    jitted = jax.jit(prefill_and_decode)(feats)
    np.testing.assert_allclose(eager, jitted, rtol=1e-4, atol=1e-4)
    with pytest.raises(AssertionError, match="target-only"):
        target(tokens, pos, None)


def test_draft_modules_do_not_import_target_code():
    for mod in (draft_mod, draft_ops):
        tree = ast.parse(inspect.getsource(mod))
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m and "decoder" in m], (mod.__name__, imported)
    assert not issubclass(Eagle3Draft, Decoder) and not issubclass(Eagle1Draft, Decoder)


def test_shared_target_arrays_and_cache(dirs, target):
    e3 = load_draft(dirs["e3"], target)
    assert e3.embed_weight is target.embed_tokens.weight.get_value()
    assert e3.lm_head is not None and e3.d2t.shape == (100,) and e3.d2t.dtype == jnp.int32
    cache = e3.init_cache(3, 40)  # 3 rows of 3 pages of 16 positions, one layer
    assert len(cache.pages.k) == 1 and cache.pages.k[0].shape == (9, 16, 2, 16)
    np.testing.assert_array_equal(cache.page_table, np.arange(9).reshape(3, 3))
    e1 = load_draft(dirs["e1"], target)
    assert e1.lm_head_weight() is target.lm_head.weight.get_value()
    assert e1.embed_tokens is not None  # the checkpoint carries its own embedding
    assert e1.draft_vocab_size == 256 and e1.max_positions == 512
