"""Engine variants for the XLA-vs-op-by-op comparison, built through the engine's seams.

Every variant is the served ``Engine`` with a different ``compile_fn`` (the engine's
public hook for turning its pure functions into executables) and a ``StepRecorder``
attached to its public step listener:

* ``xla``: ``jit_compile``, the serving path (one ``jax.jit`` executable per bucket over
  static, donated buffers).
* ``eager``: ``eager_compile`` traces each function once to a jaxpr and then evaluates
  it equation by equation: every primitive is dispatched on its own, with no XLA fusion,
  no buffer donation and no aliasing -- the JAX analogue of running a CUDA-graph engine
  with ``--disable-cuda-graph``. A Pallas kernel is one equation, so it stays one launch
  (compiled once: the traced equation is the same object at every call); on a CPU it
  runs in interpret mode in both modes.
* ``xla`` with ``--perturb`` (a test hook): the decode step only is wrapped with a
  deliberate fault before it is jitted; the comparison must catch it.

The engine builds the same ``run`` closures in every mode (same parameter merge, same
arguments to ``spec_step`` / ``prefill_chunks``); nothing of the engine is copied here,
so the comparison follows the engine as it evolves.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from eagle_jax.engine.buckets import ExecutableKey
from eagle_jax.engine.engine import Engine
from eagle_jax.engine.executables import TRACE_LOCK, jit_compile
from eagle_jax.eval.recording import StepRecorder

PERTURB_KINDS = ("none", "weight-noise", "flip-token")


def eager_compile(key: ExecutableKey, fn: Callable, example_args: tuple,
                  donate_argnums: tuple[int, ...]) -> Callable:
    """A ``CompileFn`` whose executables run ``fn``'s equations one by one."""
    del key, donate_argnums  # donation means nothing without an executable to alias in
    with TRACE_LOCK:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example_args)
    run_equations = jaxpr_as_fun(closed)
    out_tree = jax.tree.structure(out_shape)

    def call(*args):
        return jax.tree.unflatten(out_tree, run_equations(*jax.tree.leaves(args)))

    return call


def _weight_noise(params, scale: float, key):
    """Every floating parameter x -> x * (1 + scale * N(0, 1)) (fixed key)."""
    leaves, treedef = jax.tree.flatten(params)
    out = []
    for i, x in enumerate(leaves):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            n = jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32)
            x = (x.astype(jnp.float32) * (1.0 + scale * n)).astype(x.dtype)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def _flip_last_token(state, out):
    """The last token each row committed (the new last_token) -> its neighbour id
    (t - 1, or 1 for t = 0): another valid id, whatever the vocabulary."""
    last = jnp.maximum(out.num_tokens - 1, 0)
    old = jnp.take_along_axis(out.tokens, last[:, None], axis=1)[:, 0]
    live = out.num_tokens > 0
    new = jnp.where(live, jnp.where(old > 0, old - 1, 1), old)
    cols = jnp.arange(out.tokens.shape[1])[None]
    tokens = jnp.where((cols == last[:, None]) & live[:, None], new[:, None], out.tokens)
    batch = out.tokens.shape[0]
    last_token = state.last_token.at[:batch].set(
        jnp.where(live, new, state.last_token[:batch]))
    return state._replace(last_token=last_token), out._replace(tokens=tokens)


def perturbed_compile(perturb: str, scale: float) -> Callable:
    """A ``CompileFn`` that jits a faulty decode step (prefill and slot updates intact).

    ``weight-noise``: inside the step, every target parameter is scaled by
    (1 + scale * N(0, 1)) with a fixed key, so the target logits of every decode step
    are off (as a stale or corrupted verify buffer would make them); greedy tokens flip
    wherever the top logits are close. ``flip-token``: the last token each step commits
    (the correction / bonus token, i.e. the new ``last_token``) becomes a neighbouring
    id, state kept consistent.
    """
    if perturb not in PERTURB_KINDS or perturb == "none":
        raise ValueError(f"perturb must be one of {PERTURB_KINDS[1:]}, got {perturb!r}")

    def faulty(run):
        def wrapped(target_params, draft_params, *rest):
            if perturb == "weight-noise":
                target_params = _weight_noise(target_params, scale, jax.random.PRNGKey(1234))
            state, out = run(target_params, draft_params, *rest)
            if perturb == "flip-token":
                state, out = _flip_last_token(state, out)
            return state, out

        return wrapped

    def compile_fn(key, fn, example_args, donate_argnums):
        return jit_compile(key, faulty(fn) if key.name == "step" else fn, example_args,
                           donate_argnums)

    return compile_fn


def make_engine(mode: str, config, *, tokenizer=None, perturb: str = "none",
                perturb_scale: float = 0.5, draft_probs_hook=None
                ) -> tuple[Engine, StepRecorder]:
    """The engine of one comparison mode ("xla" or "eager") and its step recorder."""
    if mode == "xla":
        compile_fn = (jit_compile if perturb == "none"
                      else perturbed_compile(perturb, perturb_scale))
    elif mode == "eager":
        compile_fn = eager_compile
    else:
        raise ValueError(f"unknown mode {mode!r}")
    engine = Engine(config, tokenizer=tokenizer, draft_probs_hook=draft_probs_hook,
                    compile_fn=compile_fn)
    return engine, StepRecorder(engine)
