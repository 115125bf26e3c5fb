"""The draft unrolled on its own outputs ("training-time test", EAGLE-3), and the losses.

For a training sequence x_0 .. x_{T-1} with target features f_j and the target's top-1
tokens y_j (the target's prediction of x_{j+1}), unroll step s = 0 .. k-1 treats row j as
the draft's s-th step after a prefix that ended at position j:

* input token x_{j+s+1}, rotary position j + s;
* input hidden: project(f_j) at s = 0, else row j's ``hidden_out`` of step s - 1;
* attention: the step-0 keys of rows 0..j (the prefix, computed from target features, as
  the KV cache holds it at inference) plus row j's own keys of steps 1..s (the earlier
  draft steps of this proposal); exactly what the cache of ``draft_decode_step`` holds;
* label: y_{j+s+1} (predicting x_{j+s+2}); valid while j + s + 1 < T.

``unrolled_forward`` runs the draft's own ``forward`` with this attention plugged in,
so the layers are the inference code. At s = 0 it equals the draft's ``__call__`` over a
fresh cache (tested), and step s at row j equals s decode steps after an extend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array


def ttt_attention(q: Array, keys: list[Array], values: list[Array]) -> Array:
    """q [B, T, N, D]; keys/values: per unroll step [B, T, K, D].

    Row j attends causally to step 0's rows 0..j and to its own row of steps 1..s.
    Returns [B, T, N, D] in q's dtype.
    """
    b, t, n, d = q.shape
    kh = keys[0].shape[2]
    qg = q.reshape(b, t, kh, n // kh, d)
    scale = 1.0 / math.sqrt(d)
    s0 = jnp.einsum("btkgd,bskd->bkgts", qg, keys[0], preferred_element_type=jnp.float32)
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T(query), T(key)]
    s0 = jnp.where(causal, s0 * scale, -jnp.inf)
    diag = [jnp.einsum("btkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32)[..., None]
            * scale for k in keys[1:]]
    probs = jax.nn.softmax(jnp.concatenate([s0] + diag, axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t].astype(values[0].dtype), values[0],
                     preferred_element_type=jnp.float32)
    for i, v in enumerate(values[1:]):
        p = probs[..., t + i]  # [B, K, G, T]
        out = out + jnp.einsum("bkgt,btkd->btkgd", p.astype(v.dtype), v,
                               preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, d).astype(q.dtype)


def shift_left(x: Array, s: int, fill=0) -> Array:
    """x [B, T, ...] -> x[:, s:] padded with ``fill`` to length T."""
    if s == 0:
        return x
    pad = jnp.full((x.shape[0], s) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, s:], pad], axis=1)


def unrolled_forward(draft, tokens: Array, features: Array, steps: int) -> list[Array]:
    """tokens [B, T] (x_0..x_{T-1}), features [B, T, F] -> hidden_out [B, T, H] per step.

    Step s, row j: token x_{j+s+1} at position j + s (see the module docstring).
    """
    b, t = tokens.shape
    inv_freq = draft.inv_freq
    base = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    kv: list[tuple[list[Array], list[Array]]] = [([], []) for _ in range(draft.config.num_layers)]
    hidden = draft.project(features)
    outs = []
    for s in range(steps):
        positions = base + s

        def attend(i, attn, x, carry, positions=positions):
            q, k, v = attn.qkv(x, positions, inv_freq)
            ks, vs = carry[i]
            ks.append(k)
            vs.append(v)
            out = ttt_attention(q, ks, vs)
            return attn.o_proj(out.reshape(b, t, -1)), carry

        hidden, kv = draft.forward(shift_left(tokens, s + 1), hidden, attend, kv)
        outs.append(hidden)
    return outs


def step_labels(top: Array, steps: int) -> tuple[list[Array], list[Array]]:
    """The target's top-1 token each step predicts, and where it exists.

    top [B, T] (top[j] = the target's prediction of x_{j+1}) -> per step s: labels
    [B, T] = top[j + s + 1] and valid [B, T] = j + s + 1 < T.
    """
    t = top.shape[1]
    j = jnp.arange(t)[None, :]
    labels = [shift_left(top, s + 1) for s in range(steps)]
    valid = [jnp.broadcast_to(j + s + 1 < t, top.shape) for s in range(steps)]
    return labels, valid


def hard_label_ce(logits: Array, draft_labels: Array, valid: Array) -> Array:
    """Mean cross-entropy of the draft's logits [B, T, Vd] against draft-vocabulary labels
    [B, T] (-1: the target's token is outside the draft vocabulary, masked) over ``valid``
    [B, T] positions. Returns float32 []."""
    mask = (valid & (draft_labels >= 0)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.maximum(draft_labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def soft_label_kl(logits: Array, target_logits: Array, target_lse: Array | None,
                  valid: Array) -> Array:
    """Forward KL(p || q), averaged over positions weighted by covered target mass.

    logits [B, T, Vd]: the draft's (q = softmax). target_logits [B, T, Vd]: the target's
    logits at the draft vocabulary's target ids (p = their softmax, i.e. the target's
    temperature-1 distribution restricted to the draft vocabulary and renormalised).
    target_lse [B, T]: logsumexp of the target's logits over its whole vocabulary (None:
    the draft vocabulary is the whole one). valid [B, T] bool.

    Position weight: valid * m, m = exp(logsumexp(target_logits) - target_lse) in [0, 1],
    the target mass the draft vocabulary covers (a position whose mass lies outside the
    draft vocabulary cannot be accepted anyway, and with a one-hot target this is exactly
    ``hard_label_ce``'s mask). The loss is sum(w * KL) / sum(w). KL differs from the
    cross-entropy -sum p log q only by p's entropy (no gradient), so it is zero at q = p.
    The target side gets no gradient. Returns float32 [].
    """
    tl = jax.lax.stop_gradient(target_logits.astype(jnp.float32))
    logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jax.nn.log_softmax(tl, axis=-1)
    p = jnp.exp(logp)
    kl = jnp.sum(jnp.where(p > 0, p * (jnp.where(p > 0, logp, 0.0) - logq), 0.0), axis=-1)
    w = valid.astype(jnp.float32)
    if target_lse is not None:
        lse = jax.lax.stop_gradient(target_lse.astype(jnp.float32))
        w = w * jnp.clip(jnp.exp(jax.nn.logsumexp(tl, axis=-1) - lse), 0.0, 1.0)
    total = jnp.sum(w)
    return jnp.sum(w * kl) / jnp.where(total > 0, total, 1.0)


def target_logits(batch: dict, target_head: Array) -> Array:
    """The target's logits at the draft vocabulary's ids, float32 [B, T, Vd], recomputed
    from the cached final hidden states ``batch["target_hidden"]`` [B, T, H] and the
    target LM head's rows of those ids, ``target_head`` [Vd, H]."""
    return jnp.einsum("bth,vh->btv", batch["target_hidden"].astype(target_head.dtype),
                      target_head, preferred_element_type=jnp.float32)


def eagle3_loss(draft, batch: dict, steps: int, t2d_ids: Array, decay: float = 0.8, *,
                label_mode: str = "hard", target_head: Array | None = None):
    """Training-time-test loss: sum_s decay^s * loss_s(draft logits at step s).

    label_mode "hard": loss_s = CE against the target's top-1 token (``hard_label_ce``);
    t2d_ids [V] maps target ids to draft ids (-1: not in the draft vocabulary; those
    positions are masked). "soft": loss_s = ``soft_label_kl`` against the target's
    next-token distribution over the draft vocabulary, whose logits are
    ``batch["target_hidden"] @ target_head.T`` (target_head [Vd, H]: the target LM head's
    rows of the draft vocabulary's target ids) with ``batch["target_lse"]`` for the
    covered mass. Returns (loss, per-step loss [steps]).
    """
    outs = unrolled_forward(draft, batch["tokens"], batch["features"], steps)
    labels, valid = step_labels(batch["top"], steps)
    if label_mode == "soft":
        if target_head is None or "target_hidden" not in batch:
            raise ValueError("soft labels need target_head and batch['target_hidden'] / "
                             "batch['target_lse']")
        t_logits = target_logits(batch, target_head)
        t_lse = batch["target_lse"]
    elif label_mode != "hard":
        raise ValueError(f"label_mode must be 'hard' or 'soft', got {label_mode!r}")
    total, per_step = 0.0, []
    for s, h in enumerate(outs):
        logits = draft.logits(h)
        if label_mode == "soft":  # the target's distribution of x_{j+s+2}: row j + s + 1
            ls = soft_label_kl(logits, shift_left(t_logits, s + 1),
                               shift_left(t_lse, s + 1, 0.0), valid[s])
        else:
            ls = hard_label_ce(logits, jnp.take(t2d_ids, labels[s]), valid[s])
        per_step.append(ls)
        total = total + (decay ** s) * ls
    return total, jnp.stack(per_step)


def smooth_l1(x: Array, y: Array) -> Array:
    d = jnp.abs(x - y)
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5)


def eagle1_loss(draft, batch: dict, *, v_weight: float = 1.0, p_weight: float = 0.1,
                noise_key: Array | None = None, noise_std: float = 0.0):
    """EAGLE-1: smooth-L1 regression of the target's next hidden state + cross-entropy
    against the target's next-token distribution (softmax of its LM head on that hidden
    state), at step 0 (teacher forcing) as in the published recipe. Optional uniform
    feature noise (EAGLE-1's augmentation). Returns (loss, [vloss, ploss])."""
    feats = batch["features"]
    if noise_key is not None and noise_std > 0:
        feats = feats + jax.random.uniform(noise_key, feats.shape, jnp.float32,
                                           -noise_std, noise_std).astype(feats.dtype)
    pred = unrolled_forward(draft, batch["tokens"], feats, 1)[0].astype(jnp.float32)
    t = pred.shape[1]
    target_h = shift_left(batch["features"], 1).astype(jnp.float32)
    mask = (jnp.arange(t) < t - 1).astype(jnp.float32)[None, :]
    vloss = jnp.sum(jnp.mean(smooth_l1(pred, target_h), -1) * mask) / (
        jnp.sum(mask) * pred.shape[0])
    target_p = jax.nn.softmax(draft.logits(target_h), axis=-1)
    logp = jax.nn.log_softmax(draft.logits(pred), axis=-1)
    ploss = jnp.sum(-jnp.sum(target_p * logp, -1) * mask) / (jnp.sum(mask) * pred.shape[0])
    return v_weight * vloss + p_weight * ploss, jnp.stack([vloss, ploss])


def step_metrics(draft, batch: dict, steps: int,
                 target_head: Array | None = None) -> dict[str, Array]:
    """Held-out quality per unroll step, each [steps] (sums; divide by ``count``).

    ``correct``: the draft's argmax (mapped to target ids through d2t) equals the target's
    top-1 token (a target token outside the draft vocabulary counts as a miss): the
    acceptance of greedy drafting. ``count``: valid rows. With ``target_head`` [Vd, H] and
    ``batch["target_hidden"]`` / ``batch["target_lse"]`` (soft-label data) also ``accept``:
    sum_x min(p(x), q(x)) over the draft vocabulary, p the target's full-vocabulary
    temperature-1 distribution and q the draft's: the probability that rejection sampling
    accepts the draft's sampled token at this step, given the earlier steps were accepted.
    """
    outs = unrolled_forward(draft, batch["tokens"], batch["features"], steps)
    labels, valid = step_labels(batch["top"], steps)
    d2t = draft.d2t
    if target_head is not None:
        t_logp = (target_logits(batch, target_head)
                  - batch["target_lse"].astype(jnp.float32)[..., None])
    out = dict(correct=[], count=[], accept=[])
    for s, h in enumerate(outs):
        logits = draft.logits(h)
        pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if d2t is not None:
            pred = pred + jnp.take(d2t, pred)
        out["correct"].append(jnp.sum((pred == labels[s]) & valid[s]))
        out["count"].append(jnp.sum(valid[s]))
        if target_head is not None:  # the target's distribution of x_{j+s+2}: row j + s + 1
            p = jnp.exp(shift_left(t_logp, s + 1, -jnp.inf))
            q = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
            out["accept"].append(jnp.sum(jnp.where(valid[s], jnp.sum(jnp.minimum(p, q), -1), 0.0)))
    return {k: jnp.stack(v) for k, v in out.items() if v}
