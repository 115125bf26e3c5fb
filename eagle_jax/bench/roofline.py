"""The roofline of a decode step, plain and speculative: the speed-up speculation can
reach on a device, against which the benchmarks judge the one they measure.

Every forward of a decode step reads its model's weights once and its rows' live KV
entries once, and does 2 FLOPs per matmul parameter per row plus 4 per attended key per
head dimension per layer (QK and PV). Its roofline time is the larger of the bytes over
the copy bandwidth and the FLOPs over the matmul throughput, both measured in the same
run (``timing.copy_bandwidth``, ``timing.matmul_throughput``): a bound no kernel beats.

A plain step is one target forward over B rows. A speculative chain step of draft
length S (``engine/step.py``'s ``spec_step``) is

- the target's verify forward over B (S + 1) rows, every row through the LM head;
- S draft forwards: S - 1 decode steps of B rows (each through the draft's LM head),
  and the draft's extend over the B (S + 1) verified rows, one row each through its head.

With each draft token accepted with probability a (the benchmarks' synthetic
acceptance), a row commits E(S) = 1 + a + ... + a^S tokens a step. The step's speed-up
over plain decoding is E(S) t_plain / t_spec(S), and the roofline-optimal speed-up its
maximum over S (S = 0, plain decoding itself, gives 1). At batch 1 the steps read the
same weights whatever the rows, so a longer draft costs only the draft's reads; as the
batch grows the verify's B (S + 1) rows become compute-bound and the best S shrinks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.engine.draft_policy import expected_tokens as policy_expected_tokens


def weight_bytes(model) -> int:
    """Bytes of the parameters one forward reads at least once: all of them but an
    untied embedding table, of which it reads only its tokens' rows (a tied table is
    also the LM head, read whole). Until 2026-12-06 the table was counted: at the
    Llama-3.1-8B shape 16.06 GB where a forward reads 15.01, 7% too many."""
    return sum(v.size * v.dtype.itemsize for v in _read_params(model))


def kv_bytes_per_token(shape: dict, itemsize: int) -> int:
    """K and V bytes of one position over every layer of a target of ``shape``."""
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * itemsize


def _read_params(model) -> list:
    """The parameter arrays a forward reads whole (``weight_bytes``)."""
    params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    embed = getattr(model, "embed_tokens", None)  # (None: a draft borrowing the target's)
    if embed is not None and not getattr(model.config, "tie_word_embeddings", False):
        params = [v for v in params if v is not embed.weight]
    return params


@dataclasses.dataclass(frozen=True)
class Device:
    """The two roofs, measured in the same run as the steps they judge."""

    copy_bytes_per_s: float  # bytes read + written per second (``timing.copy_bandwidth``)
    matmul_flops_per_s: float  # dense FLOP/s in the model's dtype (``matmul_throughput``)


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """What one forward of a model costs, per row and per attended key."""

    weight_bytes: int  # read once a forward
    body_params: int  # matmul parameters every row goes through
    head_params: int  # the LM head's, for the rows that get logits
    kv_bytes_per_token: int  # K and V of one position, every layer
    attention_flops_per_key: int  # per row and attended key: 4 x heads x head_dim x layers

    @classmethod
    def of(cls, model, kv_itemsize: int | None = None) -> "ModelCost":
        """A target (``Decoder``) or a draft (``Eagle3Draft`` / ``Eagle1Draft``). A draft
        that borrows the target's LM head reads it too: its bytes are counted here.
        ``kv_itemsize``: the KV pool's bytes per value (1: an FP8 cache); default the
        activations'."""
        cfg = model.config
        head = model.lm_head_weight
        head = head() if callable(head) else head  # (a draft's is a method)
        params = _read_params(model)
        matmul = sum(v.size for v in params if v.ndim >= 2)
        nbytes = sum(v.size * v.dtype.itemsize for v in params)  # (weight_bytes)
        if not any(v.shape == head.shape for v in params):  # borrowed, not a parameter
            matmul += head.size
            nbytes += head.size * head.dtype.itemsize
        itemsize = kv_itemsize or jnp.dtype(head.dtype).itemsize  # the pool's
        return cls(
            weight_bytes=nbytes, body_params=matmul - head.size, head_params=head.size,
            kv_bytes_per_token=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize,
            attention_flops_per_key=4 * cfg.num_heads * cfg.head_dim * cfg.num_layers)

    def forward_seconds(self, device: Device, rows: int, head_rows: int,
                        kv_tokens: int, keys: int) -> float:
        """One forward: ``rows`` through the body, ``head_rows`` of them through the LM
        head, ``kv_tokens`` live positions read, ``keys`` (row, key) pairs attended."""
        nbytes = self.weight_bytes + kv_tokens * self.kv_bytes_per_token
        flops = (2 * (rows * self.body_params + head_rows * self.head_params)
                 + keys * self.attention_flops_per_key)
        return max(nbytes / device.copy_bytes_per_s, flops / device.matmul_flops_per_s)


def expected_tokens(acceptance: float, draft_length: int) -> float:
    """E(S) = 1 + a + ... + a^S: the tokens a row commits in a step of draft length S
    when each draft token is accepted with probability a (the adaptive policy's
    ``draft_policy.expected_tokens`` at a constant per-position rate)."""
    return float(policy_expected_tokens(np.full(draft_length, acceptance), [draft_length])[0])


@dataclasses.dataclass(frozen=True)
class SpecRoofline:
    """The roofline of plain and speculative chain steps of a target and its draft."""

    target: ModelCost
    draft: ModelCost
    device: Device

    def plain_step_s(self, batch: int, live: float) -> float:
        """A plain step of ``batch`` rows of ``live`` positions each."""
        return self.target.forward_seconds(self.device, batch, batch, batch * live,
                                           batch * live)

    def spec_step_s(self, batch: int, live: float, draft_length: int) -> float:
        """A chain step of draft length S (S = 0: the target's step alone)."""
        s, b = draft_length, batch
        if s == 0:
            return self.plain_step_s(b, live)
        verify = self.target.forward_seconds(self.device, b * (s + 1), b * (s + 1), b * live,
                                             b * (s + 1) * live)
        decode = self.draft.forward_seconds(self.device, b, b, b * live, b * live)
        extend = self.draft.forward_seconds(self.device, b * (s + 1), b, b * live,
                                            b * (s + 1) * live)
        return verify + (s - 1) * decode + extend

    def speedup(self, batch: int, live: float, acceptance: float, draft_length: int) -> float:
        """Committed tokens per second of chain steps of length S over plain decoding's."""
        return (expected_tokens(acceptance, draft_length) * self.plain_step_s(batch, live)
                / self.spec_step_s(batch, live, draft_length))

    def optimal(self, batch: int, live: float, acceptance: float,
                draft_lengths=range(0, 9)) -> tuple[int, float]:
        """(S*, its speed-up): the draft length of ``draft_lengths`` with the largest
        roofline speed-up (S = 0 gives 1)."""
        return max(((s, self.speedup(batch, live, acceptance, s)) for s in draft_lengths),
                   key=lambda sv: sv[1])
