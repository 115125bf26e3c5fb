"""Mode 3: a torch CUDA-graph replay reference of the speculative sampling stage (seed 004).

What it reproduces. In the engine of write-up 004, the draft stage ran inside a captured
CUDA graph and returned ``draft_probs``, a tensor in the graph's private memory pool
that nothing kept alive; the verify stage, captured afterwards into the same pool, put a
temporary (a top-k attention mask that writes -inf past each sequence's valid region)
on the recycled block. Replay order is draft graph, verify graph, sampler, so the
sampler read the verify stage's -inf mask where it expected probabilities: non-finite
``q``, ``p - q = +inf``, a residual draw that never fires, a fallback id
``VOCAB_SIZE - 1`` past the tokenizer vocabulary, and draft tokens accepted
unconditionally (``u * -inf < p``).

How. Per decode step, fresh seeded logits (target ``[B, S+1, W]``, draft = target +
noise, W = the padded embedding width) are copied into the static input buffers, then:

1. graph A (captured): ``q = softmax(draft_logits / T)``; draft tokens by inverse CDF
   from static uniforms. Only the tokens are kept as a graph output; ``q`` is returned
   as a non-owning view of its block (``__cuda_array_interface__``), as the runner of
   004 returned it, so the pool considers the block free after capture;
2. graph B (captured into the same pool, replayed *before* the sampler): allocates a
   ``[B, S, W]`` float32 temporary (``torch.empty``, i.e. the freed block) and writes
   -inf at columns >= a per-row 64-aligned boundary that advances with the step (the
   mask's valid region tracks the sequence), then produces ``p = softmax(target / T)``;
3. the rejection sampler (torch, the project's accept rule) reads ``q`` and ``p``.

Variants: with and without the copy-out fix (``q`` cloned right after graph A, before
graph B), times two samplers: *unguarded* (pre-004: ``q == q`` as the only check, a
fallback of ``W - 1``) and *guarded* (004 / ``eagle_jax.kernels.spec_sampler``: accept
only if ``q(d)`` is in (0, 1]; q entries outside [0, 1] count as 0 in the residual; a
zero-mass residual falls back to ``p``; ids never reach the tokenizer vocabulary).
Whether graph B's temporary really landed on ``q``'s block is checked (``recycled``)
and reported: the caching allocator decides, the tool does not force it.

Without a torch GPU (``torch.cuda.is_available()`` false) the mode reports
"skipped: no torch GPU". ``emulate=True`` (tests only) runs the same stages eagerly on
any device with the recycling made explicit (graph B's temporary *is* q's buffer), to
exercise the sampler and the bookkeeping without a GPU.
"""

from __future__ import annotations


class _CudaArray:
    """A non-owning description of device memory (CUDA Array Interface v2)."""

    def __init__(self, ptr: int, shape: tuple[int, ...]):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": "<f4",
                                         "data": (int(ptr), False), "version": 2,
                                         "strides": None}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def rejection_sample(torch, draft_tokens, q, p, u_accept, u_final, vocab_size: int,
                     guarded: bool):
    """The project's accept rule, in torch. Shapes: draft_tokens [B, S], q [B, S, W],
    p [B, S+1, W], u_accept [B, S], u_final [B]. Returns (tokens [B, S+1] with -1 past
    the committed ones, accept_len [B], num_fallback [B], num_malformed [B])."""
    B, S = draft_tokens.shape
    W = p.shape[-1]
    dev = p.device
    rows = torch.arange(B, device=dev)
    out = torch.full((B, S + 1), -1, dtype=torch.long, device=dev)
    accept = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    fallback = torch.zeros(B, dtype=torch.long, device=dev)
    malformed = torch.zeros(B, dtype=torch.long, device=dev)
    cols = torch.arange(W, device=dev)

    def draw(weights, u, live):
        """Inverse-CDF draw from unnormalised weights [B, W]; returns (ids, fell_back)."""
        total = weights.sum(-1)
        if guarded:
            weights = torch.where(cols[None] < vocab_size, weights, torch.zeros_like(weights))
            total = weights.sum(-1)
            empty = ~(total > 0) | ~torch.isfinite(total)
            cdf = weights.cumsum(-1)
            idx = torch.searchsorted(cdf, (u * total)[:, None], right=True)[:, 0]
            idx = torch.clamp(idx, max=vocab_size - 1)
            return idx, empty & live
        # Unguarded (pre-004): scan for cumsum > u * sum; if none, the fixed fallback.
        cdf = weights.cumsum(-1)
        hit = cdf > (u * total)[:, None]
        found = hit.any(-1)
        idx = torch.where(found, hit.float().argmax(-1), torch.full_like(total, W - 1).long())
        return idx, ~found & live

    for i in range(S):
        d = draft_tokens[:, i].long()
        dc = d.clamp(0, W - 1)
        qd, pd = q[rows, i, dc], p[rows, i, dc]
        if guarded:
            q_ok = (qd > 0) & (qd <= 1)
            acc = q_ok & (d >= 0) & (d < vocab_size) & (u_accept[:, i] * qd < pd)
            malformed += (alive & ~q_ok).long()
        else:
            acc = (qd == qd) & (u_accept[:, i] * qd < pd)
        acc = acc & alive
        out[:, i] = torch.where(acc, d, out[:, i])
        accept += acc.long()
        rejected = alive & ~acc
        if rejected.any():
            qi = q[:, i]
            if guarded:
                qi = torch.where((qi >= 0) & (qi <= 1), qi, torch.zeros_like(qi))
                resid = torch.clamp(p[:, i] - qi, min=0)
                idx, empty = draw(resid, u_final, rejected)
                # A zero-mass residual falls back to p itself.
                idx_p, _ = draw(p[:, i], u_final, rejected)
                idx = torch.where(empty, idx_p, idx)
                fallback += (empty & rejected).long()
            else:
                qi = torch.where(qi == qi, qi, torch.zeros_like(qi))
                resid = torch.clamp(p[:, i] - qi, min=0)
                idx, empty = draw(resid, u_final, rejected)
                fallback += empty.long()
            out[:, i] = torch.where(rejected, idx, out[:, i])
        alive = alive & acc
    bonus, _ = draw(p[:, S], u_final, alive)
    out[:, S] = torch.where(alive, bonus, out[:, S])
    return out, accept, fallback, malformed


class _Stages:
    """The draft and verify stages as captured graphs (GPU) or explicitly aliased (emulate)."""

    def __init__(self, torch, device, B, S, W, temperature, emulate: bool):
        self.torch, self.B, self.S, self.W, self.T = torch, B, S, W, temperature
        self.emulate = emulate
        self.draft_logits = torch.zeros(B, S, W, device=device)
        self.target_logits = torch.zeros(B, S + 1, W, device=device)
        self.u_draft = torch.zeros(B, S, device=device)
        self.boundary = torch.zeros(B, device=device, dtype=torch.long)
        self.cols = torch.arange(W, device=device)
        self.recycled = None
        if emulate:
            self._q_block = torch.empty(B, S, W, device=device)
            self._setup_emulated()
        else:
            self._capture(device)

    # The two stage bodies, shared by both paths.
    def _draft_body(self, out=None):
        # The static logits already hold logits / T, and the CDF is taken in float64, so
        # that q is the only [B, S, W] float32 block graph A allocates (and frees).
        torch = self.torch
        q = torch.softmax(self.draft_logits, dim=-1, out=out) if out is not None else \
            torch.softmax(self.draft_logits, dim=-1)
        cdf = q.double().cumsum(-1)
        tokens = torch.searchsorted(cdf, self.u_draft.double().unsqueeze(-1)).squeeze(-1)
        return q, tokens.clamp(max=self.W - 1)

    def _verify_body(self, temp=None):
        torch = self.torch
        mask = torch.empty(self.B, self.S, self.W, device=self.cols.device) if temp is None else temp
        past = self.cols[None, None, :] >= self.boundary[:, None, None]
        mask.masked_fill_(past, float("-inf"))
        p = torch.softmax(self.target_logits, dim=-1)
        selected = (self.target_logits[:, :self.S] + mask).amax(-1)  # the mask's consumer
        return p, selected, mask.data_ptr()

    def _setup_emulated(self):
        self.recycled = True

        def draft():
            q, tokens = self._draft_body(out=self._q_block)
            return q, tokens

        def verify():
            p, _, _ = self._verify_body(temp=self._q_block)  # the recycled block, explicitly
            return p

        self._draft, self._verify = draft, verify

    def _capture(self, device):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside capture, as torch requires
            for _ in range(2):
                self._draft_body()
                self._verify_body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.graph_a = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph_a, pool=pool):
            q, tokens = self._draft_body()
        q_ptr = q.data_ptr()
        # The runner of 004 kept the tokens (the target forward consumes them) but not q.
        self.q_view = torch.as_tensor(_CudaArray(q_ptr, tuple(q.shape)), device=device)
        self.tokens = tokens
        del q
        self.graph_b = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph_b, pool=pool):
            p, selected, mask_ptr = self._verify_body()
        self.p, self.selected = p, selected
        self.recycled = mask_ptr == q_ptr

        def draft():
            self.graph_a.replay()
            return self.q_view, self.tokens

        def verify():
            self.graph_b.replay()
            return self.p

        self._draft, self._verify = draft, verify

    def run(self, copy_out: bool):
        """One replayed step: draft graph, (copy-out), verify graph. Returns (q, tokens, p)
        as the sampler reads them."""
        q, tokens = self._draft()
        tokens = tokens.clone()
        if copy_out:
            q = q.clone()  # the 004 fix: copy draft_probs out at the graph boundary
        p = self._verify()
        return q, tokens, p


def run_torch_replay(*, batch: int, num_steps: int, vocab_size: int, width: int | None = None,
                     steps: int = 16, temperature: float = 1.0, seed: int = 0,
                     emulate: bool = False, device: str | None = None) -> dict:
    """Runs the four variants over ``steps`` replayed decode steps; returns the report."""
    try:
        import torch
    except ImportError:
        return {"status": "skipped: torch is not installed"}
    if not emulate and not torch.cuda.is_available():
        return {"status": "skipped: no torch GPU"}
    if not temperature > 0:
        raise ValueError("the replay reference samples: its temperature must be > 0")
    dev = torch.device(device or ("cpu" if emulate else "cuda"))
    B, S = batch, num_steps
    W = width if width and width > vocab_size else _round_up(vocab_size + 1, 64)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Per step: logits, uniforms and mask boundaries, drawn once, shared by every variant.
    start = torch.randint(1, max(2, W // 2), (B,), generator=gen)
    inputs = []
    pos = start.clone()
    for _ in range(steps):
        target = torch.randn(B, S + 1, W, generator=gen) * 3.0
        draft = target[:, :S] + torch.randn(B, S, W, generator=gen)
        # Embedding padding (columns >= vocab) is untrained: far below every real logit.
        target[..., vocab_size:] = -30.0
        draft[..., vocab_size:] = -30.0
        boundary = torch.clamp(((pos + 63) // 64) * 64, max=W)
        inputs.append(dict(target=target, draft=draft,
                           u_draft=torch.rand(B, S, generator=gen),
                           u_accept=torch.rand(B, S, generator=gen),
                           u_final=torch.rand(B, generator=gen), boundary=boundary))
        pos = pos + S // 2 + 1  # the valid region advances with the decode step
    stages = _Stages(torch, dev, B, S, W, float(temperature), emulate)
    variants = {}
    for copy_out in (False, True):
        for guarded in (False, True):
            name = f"{'copy-out' if copy_out else 'no copy-out'}, " \
                   f"{'guarded' if guarded else 'unguarded'} sampler"
            acc_hist, per_pos = [], [0] * S
            nonfinite = not_prob = fallbacks = stray = drafts = 0
            tokens_all = []
            for x in inputs:
                stages.target_logits.copy_((x["target"] / temperature).to(dev))
                stages.draft_logits.copy_((x["draft"] / temperature).to(dev))
                stages.u_draft.copy_(x["u_draft"].to(dev))
                stages.boundary.copy_(x["boundary"].to(dev))
                q, d, p = stages.run(copy_out)
                toks, acc, fb, _ = rejection_sample(
                    torch, d, q, p, x["u_accept"].to(dev), x["u_final"].to(dev), vocab_size,
                    guarded)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                nonfinite += int((~torch.isfinite(q)).sum())
                not_prob += int(((q < 0) | (q > 1) | ~torch.isfinite(q)).sum())
                fallbacks += int(fb.sum())
                committed = toks[toks >= 0]
                stray += int((committed >= vocab_size).sum())
                drafts += B
                for a in acc.tolist():
                    acc_hist.append(a)
                    for i in range(a):
                        per_pos[i] += 1
                tokens_all.append(toks.cpu())
            variants[name] = {
                "copy_out": copy_out, "guarded_sampler": guarded,
                "mean_accept_length": 1 + sum(acc_hist) / drafts,
                "acceptance_per_position": [c / drafts for c in per_pos],
                "nonfinite_draft_probs": nonfinite,
                "non_probability_draft_probs": not_prob,
                "sampler_fallbacks": fallbacks,
                "tokens_ge_vocab": stray,
                "num_committed_tokens": sum(int((t >= 0).sum()) for t in tokens_all),
                "_tokens": tokens_all,
            }
    ref = variants["copy-out, guarded sampler"]["_tokens"]
    for v in variants.values():
        same = sum(int((a == b).all(-1).sum()) for a, b in zip(v.pop("_tokens"), ref))
        v["step_agreement_with_fixed"] = same / (steps * B)
    bad = variants["no copy-out, unguarded sampler"]
    fixed = variants["copy-out, guarded sampler"]
    return {
        "status": "ran (emulated recycling, no CUDA graphs)" if emulate else "ran",
        "device": str(dev) if emulate else torch.cuda.get_device_name(dev),
        "batch": B, "num_steps": S, "steps": steps, "vocab_size": vocab_size,
        "padded_width": W, "temperature": temperature,
        "recycled": bool(stages.recycled),
        "failure_reproduced": bool(bad["nonfinite_draft_probs"] > 0 and (
            bad["sampler_fallbacks"] > 0 or bad["tokens_ge_vocab"] > 0)),
        "fix_clean": bool(fixed["nonfinite_draft_probs"] == 0 and fixed["tokens_ge_vocab"] == 0
                          and fixed["sampler_fallbacks"] == 0),
        "variants": variants,
    }


def format_replay(res: dict) -> str:
    if not res.get("status", "").startswith("ran"):
        return f"mode 3 (torch graph replay): {res.get('status')}"
    lines = [f"mode 3 (torch graph replay, {res['device']}): {res['status']}; B={res['batch']} "
             f"S={res['num_steps']} steps={res['steps']} vocab={res['vocab_size']} "
             f"width={res['padded_width']}; verify temporary on draft_probs block: "
             f"{'yes' if res['recycled'] else 'NO (failure mode not set up)'}"]
    head = f"  {'variant':34s} {'accept':>6s} {'non-finite q':>12s} {'fallbacks':>9s} " \
           f"{'ids>=vocab':>10s} {'agree w/ fix':>12s}  acc@pos"
    lines.append(head)
    for name, v in res["variants"].items():
        lines.append(
            f"  {name:34s} {v['mean_accept_length']:6.2f} {v['nonfinite_draft_probs']:12d} "
            f"{v['sampler_fallbacks']:9d} {v['tokens_ge_vocab']:10d} "
            f"{v['step_agreement_with_fixed']:12.2f}  "
            + " ".join(f"{a:.2f}" for a in v["acceptance_per_position"]))
    lines.append(f"  004 failure reproduced without copy-out: "
                 f"{'yes' if res['failure_reproduced'] else 'no'}; copy-out + guarded sampler "
                 f"clean: {'yes' if res['fix_clean'] else 'NO'}")
    return "\n".join(lines)


__all__ = ["run_torch_replay", "format_replay", "rejection_sample"]
