"""Draft training: data pipeline, the unrolled (training-time-test) forward against the
inference path, learning on a tiny target, and resuming."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from eagle_jax.models import draft_ops
from eagle_jax.models.decoder import load_decoder, save_decoder
from eagle_jax.models.draft_checkpoint import load_draft
from eagle_jax.testutil.drafts import write_tiny_eagle1_draft, write_tiny_eagle3_draft
from eagle_jax.testutil.models import write_tiny_target
from eagle_jax.train import TrainConfig, train
from eagle_jax.train import data as data_lib
from eagle_jax.train import unroll

V, SEQ = 256, 64


def markov(rng, perm, n, t, follow=0.75):
    """Sequences where x_{j+1} = perm[x_j] with probability ``follow``, else uniform."""
    x = np.zeros((n, t), np.int32)
    x[:, 0] = rng.integers(0, V, n)
    for j in range(1, t):
        x[:, j] = np.where(rng.random(n) < follow, perm[x[:, j - 1]], rng.integers(0, V, n))
    return x


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target trained briefly (30 Adam steps) on a Markov corpus, so that its next
    token is a learnable function (a random transformer's argmax is chaotic), plus a JSONL
    corpus of fresh sequences from the same chain."""
    root = tmp_path_factory.mktemp("train")
    target_dir = write_tiny_target(str(root / "target"), init_std=0.02)
    rng = np.random.default_rng(0)
    perm = rng.permutation(V)
    model = load_decoder(target_dir)
    graphdef, params = nnx.split(model)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, x):
        def loss_fn(p):
            m = nnx.merge(graphdef, p)
            pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
            logits = m(x, pos, None).logits[:, :-1]
            lp = jax.nn.log_softmax(logits, -1)
            return -jnp.mean(jnp.take_along_axis(lp, x[:, 1:, None], -1))
        grads = jax.grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    for _ in range(30):
        params, opt = step(params, opt, jnp.asarray(markov(rng, perm, 16, SEQ)))
    with open(os.path.join(target_dir, "config.json")) as f:
        hf = json.load(f)
    save_decoder(nnx.merge(graphdef, params), target_dir, hf)
    corpus = str(root / "corpus.jsonl")
    with open(corpus, "w") as f:
        for row in markov(np.random.default_rng(1), perm, 200, SEQ):
            f.write(json.dumps({"input_ids": row.tolist()}) + "\n")
    return dict(root=root, target=target_dir, corpus=corpus)


# ------------------------------------------------------------------------ data


def test_build_vocab_map_and_inverse():
    counts = np.array([5, 0, 9, 9, 1, 0, 7])
    d2t = data_lib.build_vocab_map(counts, 4)
    ids = np.arange(4) + d2t
    np.testing.assert_array_equal(ids, [0, 2, 3, 6])  # the 4 most frequent, sorted
    t2d = data_lib.target_to_draft(d2t, 7)
    np.testing.assert_array_equal(t2d, [0, -1, 1, 2, -1, -1, 3])
    with pytest.raises(ValueError):
        data_lib.build_vocab_map(counts, 8)


def test_text_corpus_tokenised_and_chunked(tmp_path):
    from eagle_jax.testutil.tokenizer import write_test_tokenizer
    from eagle_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(write_test_tokenizer(str(tmp_path / "tok")))
    docs_dir = tmp_path / "docs"
    docs_dir.mkdir()
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time. " * 4]
    for i, t in enumerate(texts):
        (docs_dir / f"{i}.txt").write_text(t)
    (docs_dir / "more.jsonl").write_text(json.dumps({"prompt": "Hi ", "response": "there"}) + "\n")
    docs = list(data_lib.read_corpus(str(docs_dir)))
    assert docs == texts + ["Hi there"]
    seqs = list(data_lib.chunk_sequences(docs, 8, tok, vocab_size=tok.vocab_size))
    flat = sum((tok.encode(d) for d in docs), [])
    assert len(seqs) == len(flat) // 8
    np.testing.assert_array_equal(np.concatenate(seqs), flat[: len(seqs) * 8])
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        list(data_lib.chunk_sequences(docs, 8, tok, vocab_size=10))


# -------------------------------------------------------- unrolled forward semantics


@pytest.mark.parametrize("kind", ["EAGLE3", "EAGLE"])
def test_unrolled_forward_equals_extend_then_decode(setup, kind):
    """Step s, row j of the training unroll == an extend over rows 0..j (target features)
    followed by s draft decode steps, exactly what inference computes."""
    target = load_decoder(setup["target"])
    ddir = str(setup["root"] / f"unroll_{kind}")
    if kind == "EAGLE3":
        write_tiny_eagle3_draft(ddir, setup["target"], draft_vocab_size=128, seed=5)
    else:
        write_tiny_eagle1_draft(ddir, setup["target"], seed=5)
    draft = load_draft(ddir, target, use_kernels=False)
    t, steps = 12, 3
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, V, (1, t)), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    out = target(tokens, pos, target.init_cache(1, t), aux_layers=draft.feature_layers or ())
    feats = out.aux_hidden if kind == "EAGLE3" else out.hidden
    unrolled = unroll.unrolled_forward(draft, tokens, feats, steps)

    @jax.jit
    def extend(j):  # rows 0..j at their positions, the rest padding (KV writes dropped)
        rows_pos = jnp.where(pos <= j, pos, 10**6)
        return draft_ops.draft_extend(draft, tokens, tokens[:, j + 1], jnp.reshape(j + 1, (1,)),
                                      feats, rows_pos, draft.init_cache(1, 32))

    decode = jax.jit(lambda tok, h, p, cache: draft_ops.draft_decode_step(draft, tok, h, p, cache))
    for j in (0, 4, 8):
        res = extend(jnp.int32(j))
        np.testing.assert_allclose(res.hidden[0], unrolled[0][0, j], rtol=1e-4, atol=1e-4)
        h, cache = res.hidden, res.cache
        for s in range(1, steps):
            _, h, cache = decode(tokens[:, j + s + 1], h, jnp.asarray([j + s]), cache)
            np.testing.assert_allclose(h[0], unrolled[s][0, j], rtol=1e-4, atol=1e-4)


def test_soft_label_kl_zero_at_target_and_hard_ce_when_one_hot():
    rng = np.random.default_rng(3)
    b, t, vd = 2, 5, 7
    tl = jnp.asarray(rng.normal(size=(b, t, vd)) * 3, jnp.float32)
    valid = jnp.asarray(rng.random((b, t)) < 0.8)
    lse = jax.nn.logsumexp(tl, -1) + jnp.asarray(rng.random((b, t)), jnp.float32)  # mass < 1
    # minimised, at zero, when the draft's logits equal the target's (up to a shift)
    assert abs(float(unroll.soft_label_kl(tl + 1.5, tl, lse, valid))) < 1e-5
    grad = jax.grad(lambda x: unroll.soft_label_kl(x, tl, lse, valid))(tl)
    np.testing.assert_allclose(grad, 0.0, atol=1e-6)
    other = jnp.asarray(rng.normal(size=(b, t, vd)), jnp.float32)
    assert float(unroll.soft_label_kl(other, tl, lse, valid)) > 0.1
    # a one-hot target (all mass on one drafted token) gives the hard-label cross-entropy
    labels = jnp.asarray(rng.integers(0, vd, (b, t)), jnp.int32)
    onehot = jnp.where(jax.nn.one_hot(labels, vd) > 0, 0.0, -jnp.inf)
    np.testing.assert_allclose(unroll.soft_label_kl(other, onehot, jnp.zeros((b, t)), valid),
                               unroll.hard_label_ce(other, labels, valid), rtol=1e-6)
    # ... also when part of the positions' mass lies outside the draft vocabulary
    # (hard: label -1, masked; soft: covered mass ~0, weight ~0)
    outside = jnp.asarray(rng.random((b, t)) < 0.4)
    lse_out = jnp.where(outside, 100.0, 0.0)
    np.testing.assert_allclose(
        unroll.soft_label_kl(other, onehot, lse_out, valid),
        unroll.hard_label_ce(other, jnp.where(outside, -1, labels), valid), rtol=1e-5)


def test_soft_label_cache_reproduces_target_logits(setup, tmp_path):
    """The soft-label cache's bf16 hidden states give the target's logits through its LM
    head (and the stored logsumexp); a hard-label cache says what it lacks."""
    target = load_decoder(setup["target"])
    seqs = markov(np.random.default_rng(4), np.random.default_rng(0).permutation(V), 4, 16)
    kw = dict(kind="EAGLE3", feature_layers=(0, 1), seq_len=16, batch_size=4, progress=False)
    store = data_lib.collect_features(target, list(seqs), str(tmp_path / "soft"),
                                      target_hidden=True, **kw)
    assert store.has_target_hidden
    b = store.get([0, 3], with_target_hidden=True)
    assert b["target_hidden"].dtype == jnp.bfloat16 and b["target_lse"].shape == (2, 16)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    ref = target(jnp.asarray(seqs[[0, 3]]), pos, target.init_cache(2, 16)).logits
    logits = target.logits(jnp.asarray(b["target_hidden"]))
    np.testing.assert_allclose(logits, ref, atol=0.05 * float(jnp.abs(ref).max()))
    np.testing.assert_allclose(jax.nn.logsumexp(logits, -1), b["target_lse"], rtol=1e-5)
    np.testing.assert_array_equal(jnp.argmax(ref, -1), b["top"])
    hard = data_lib.collect_features(target, list(seqs), str(tmp_path / "hard"), **kw)
    assert not hard.has_target_hidden and "target_hidden" not in hard.get([0])
    with pytest.raises(ValueError, match="no target hidden states"):
        hard.get([0], with_target_hidden=True)


def test_step_labels():
    top = jnp.arange(6)[None]
    labels, valid = unroll.step_labels(top, 2)
    np.testing.assert_array_equal(labels[0][0, :5], [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(valid[1][0], [True, True, True, True, False, False])


def test_step_metrics_against_numpy(setup):
    """Top-1 agreement and the expected rejection-sampling acceptance sum_x min(p, q) per
    unroll step, against numpy over the target's full softmax (p of x_{j+s+2} at row
    j + s + 1; target mass outside the 128-token draft vocabulary is never proposed)."""
    target = load_decoder(setup["target"])
    ddir = str(setup["root"] / "metrics_draft")
    write_tiny_eagle3_draft(ddir, setup["target"], draft_vocab_size=128, seed=7)
    draft = load_draft(ddir, target, use_kernels=False)
    b, t, steps = 2, 10, 3
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, V, (b, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = target(tokens, pos, target.init_cache(b, t), aux_layers=draft.feature_layers)
    full = np.asarray(out.logits, np.float64)  # [B, T, V]
    ids = np.arange(128) + np.asarray(draft.d2t)
    head = target.embed_tokens if target.lm_head is None else target.lm_head
    batch = dict(tokens=tokens, features=out.aux_hidden, top=jnp.argmax(out.logits, -1),
                 target_hidden=out.hidden, target_lse=jax.nn.logsumexp(out.logits, -1))
    got = unroll.step_metrics(draft, batch, steps, jnp.take(head.weight.get_value(), ids, 0))
    assert set(got) == {"correct", "count", "accept"}

    outs = unroll.unrolled_forward(draft, tokens, out.aux_hidden, steps)
    p_full = np.exp(full - full.max(-1, keepdims=True))
    p_full /= p_full.sum(-1, keepdims=True)
    for s in range(steps):
        logits = np.asarray(draft.logits(outs[s]), np.float64)
        q = np.exp(logits - logits.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        rows = t - s - 1  # rows j with a label x_{j+s+2}
        p = p_full[:, s + 1:, ids]  # [B, rows, 128]
        accept = np.minimum(p, q[:, :rows]).sum(-1)
        agree = ids[q[:, :rows].argmax(-1)] == full[:, s + 1:].argmax(-1)
        assert int(got["count"][s]) == b * rows
        assert int(got["correct"][s]) == int(agree.sum())
        np.testing.assert_allclose(float(got["accept"][s]), accept.sum(), rtol=1e-4)
        assert 0.0 < accept.min() and accept.max() < 1.0
    # without the target's hidden states: top-1 agreement only
    assert set(unroll.step_metrics(draft, batch, steps)) == {"correct", "count"}


# ------------------------------------------------------------------------ training


def test_eagle3_training_raises_heldout_accuracy(setup):
    out = str(setup["root"] / "run_e3")
    summary = train(TrainConfig(
        target=setup["target"], corpus=setup["corpus"], out=out, algorithm="EAGLE3",
        steps=150, batch_size=8, seq_len=SEQ, lr=3e-3, warmup=20, draft_vocab_size=200,
        ttt_steps=3, eval_every=150, save_every=0, eval_fraction=0.1, collect_batch_size=20,
        progress=False))
    before, after = summary["initial_eval_acc"], summary["final_eval_acc"]
    assert len(before) == len(after) == 3
    assert max(before) < 0.05, before
    assert min(after) > 0.5, after  # every unroll step, not only the first
    # the final draft is in the published layout and serves the target
    target = load_decoder(setup["target"])
    draft = load_draft(summary["draft_dir"], target)
    assert draft.draft_vocab_size == 200 and draft.d2t.shape == (200,)
    counts = np.load(os.path.join(out, "data", "top_counts.npy"))
    ids = np.arange(200) + np.asarray(draft.d2t)
    assert counts[ids].sum() == np.sort(counts)[::-1][:200].sum()  # the most frequent ids


def _load_script():
    from eagle_jax.train import draft_cli

    return draft_cli


def test_eagle1_training_via_script(setup, capsys):
    out = str(setup["root"] / "run_e1")
    script = _load_script()
    rc = script.main([
        "--target", setup["target"], "--corpus", setup["corpus"], "--out", out,
        "--algorithm", "EAGLE", "--steps", "100", "--batch-size", "8", "--seq-len", str(SEQ),
        "--lr", "3e-3", "--warmup", "20", "--ttt-steps", "2", "--eval-every", "100",
        "--save-every", "0", "--eval-fraction", "0.1", "--collect-batch-size", "20",
        "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.rindex("{\n"):])
    assert summary["step"] == 100 and summary["draft_dir"] == os.path.join(out, "draft")
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    evals = [l["eval_acc"] for l in lines if "eval_acc" in l]
    assert evals[0][0] < 0.05 and evals[-1][0] > 0.5, evals
    draft = load_draft(os.path.join(out, "draft"), load_decoder(setup["target"]))
    assert draft.kind == "EAGLE"


def test_eagle3_soft_label_training_via_script(setup, capsys):
    out = str(setup["root"] / "run_e3_soft")
    rc = _load_script().main([
        "--target", setup["target"], "--corpus", setup["corpus"], "--out", out,
        "--algorithm", "EAGLE3", "--label-mode", "soft", "--steps", "100", "--batch-size", "8",
        "--seq-len", str(SEQ), "--lr", "3e-3", "--warmup", "20", "--draft-vocab-size", "200",
        "--ttt-steps", "3", "--eval-every", "100", "--save-every", "0", "--eval-fraction",
        "0.1", "--collect-batch-size", "20", "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    summary = json.loads(stdout[stdout.rindex("{\n"):])
    before, after = summary["initial_eval_acc"], summary["final_eval_acc"]
    assert max(before) < 0.05, before
    assert min(after) > 0.5, after  # every unroll step
    # the expected acceptance of a sampled draft token at T=1 rises at every step
    before, after = summary["initial_eval_accept"], summary["final_eval_accept"]
    assert len(after) == 3 and max(before) < 0.2 and min(after) > 0.4, (before, after)
    with open(os.path.join(out, "data", "meta.json")) as f:
        assert json.load(f)["target_hidden"] is True
    losses = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    losses = [l["loss"] for l in losses if "loss" in l]
    assert losses[-1] < losses[0], losses


def test_eagle3_borrowing_the_target_head(setup):
    """lm_head="target": the draft trains with the target's head frozen over the whole
    vocabulary, its checkpoint leaves the head out, and loading borrows it again."""
    from eagle_jax.checkpoint import CheckpointReader

    out = str(setup["root"] / "run_e3_target_head")
    common = dict(target=setup["target"], corpus=setup["corpus"], algorithm="EAGLE3",
                  batch_size=8, seq_len=SEQ, lr=3e-3, warmup=20, ttt_steps=2,
                  label_mode="soft", lm_head="target", save_every=0, eval_fraction=0.1,
                  collect_batch_size=20, progress=False)
    summary = train(TrainConfig(out=out, steps=100, eval_every=100, **common))
    assert max(summary["initial_eval_accept"]) < 0.2
    assert min(summary["final_eval_acc"]) > 0.5 and min(summary["final_eval_accept"]) > 0.4
    reader = CheckpointReader(summary["draft_dir"])
    assert "lm_head.weight" not in reader.keys() and "d2t" in reader.keys()
    target = load_decoder(setup["target"])
    draft = load_draft(summary["draft_dir"], target)
    assert draft.lm_head is None and draft.draft_vocab_size == V and draft.d2t is None
    np.testing.assert_array_equal(draft.lm_head_weight(), target.embed_tokens.weight.get_value()
                                  if target.lm_head is None else target.lm_head.weight.get_value())
    trained = summary["draft"]
    h = jnp.asarray(np.random.default_rng(9).normal(size=(3, draft.config.hidden_size)),
                    jnp.float32)
    np.testing.assert_allclose(draft.logits(h), trained.logits(h), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="whole target vocabulary"):
        train(TrainConfig(out=str(setup["root"] / "bad_head"), steps=1, draft_vocab_size=200,
                          **common))


def test_resume_continues_from_saved_step(setup):
    data_dir = str(setup["root"] / "resume_data")
    common = dict(target=setup["target"], corpus=setup["corpus"], algorithm="EAGLE3",
                  steps=12, batch_size=4, seq_len=SEQ, lr=3e-3, warmup=3, draft_vocab_size=200,
                  ttt_steps=1, eval_every=0, save_every=6, data_dir=data_dir,
                  collect_batch_size=20, max_sequences=40, progress=False)
    whole = train(TrainConfig(out=str(setup["root"] / "whole"), **common))
    first = train(TrainConfig(out=str(setup["root"] / "parts"), stop_after=6, **common))
    assert first["step"] == 6
    ckpts = sorted(os.listdir(setup["root"] / "parts" / "checkpoints"))
    assert ckpts == ["step_0000006"]
    second = train(TrainConfig(out=str(setup["root"] / "parts"), resume=True, **common))
    assert second["resumed_from"].endswith("step_0000006") and second["step"] == 12
    logged = [json.loads(l)["step"] for l in open(setup["root"] / "parts" / "metrics.jsonl")]
    assert logged == [6, 10, 12]  # the stop step, then log_every=10 and the end
    a, b = nnx.state(whole["draft"], nnx.Param), nnx.state(second["draft"], nnx.Param)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    # a resumed run's optimizer state continued too: one more segment changes nothing
    third = train(TrainConfig(out=str(setup["root"] / "parts"), resume=True, **common))
    assert third["resumed_from"].endswith("step_0000012") and third["step"] == 12
