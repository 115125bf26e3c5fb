"""Engine variants for the XLA-vs-op-by-op comparison.

* ``XlaEngine``: the served engine (``jax.jit`` per bucket over static, donated
  buffers), recording every request-step (``eagle_jax.eval.recording``).
* ``EagerEngine``: the same engine whose compiled functions are replaced by the *same*
  Python functions called under ``jax.disable_jit()``: every primitive runs on its own,
  with no XLA fusion, no buffer donation and no aliasing -- the JAX analogue of running
  a CUDA-graph engine with ``--disable-cuda-graph``. Pallas kernels stay one launch each
  (see ``_cached_kernel``); on a CPU they run in interpret mode in both engines.
* ``PerturbedXlaEngine``: the served engine with a deliberate fault injected into its
  jitted decode step only (``--perturb``, a test hook): the comparison must catch it.

How the step functions are obtained. ``EagerEngine`` and ``PerturbedXlaEngine``
override ``_step_fn`` / ``_prefill_fn`` (and the slot-update properties) by calling the
engine's own method while ``jax.jit`` *as seen by* ``eagle_jax.engine.engine`` is
replaced (``_intercept_jit``): the engine builds its ``run`` closure exactly as it does
when serving (same merge of the parameters, same arguments to ``spec_step`` /
``prefill_chunk``), and hands it to our ``jit``, which returns it un-jitted (eager) or
jits a perturbed wrapper of it. Nothing of the engine's step construction is copied
here, so the comparison follows the engine as it evolves.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
import threading

import jax
import jax.numpy as jnp

from eagle_jax.engine import engine as engine_module
from eagle_jax.engine.engine import Engine
from eagle_jax.eval.recording import RecordingMixin

PERTURB_KINDS = ("none", "weight-noise", "flip-token")


_KERNEL_LOCK = threading.RLock()
_KERNEL_CACHE: dict = {}


def _cached_kernel(name: str, fn):
    """``fn`` (a ``_*_pallas`` entry point) as one compiled unit, cached per static args.

    A Pallas kernel is one launch in every mode: JAX itself compiles a ``pallas_call``
    as a unit even under ``disable_jit``. It does so, however, with a fresh closure per
    call, i.e. a recompilation of the kernel at every call, which makes an op-by-op
    step take seconds. Here the kernel entry is jitted once per static configuration
    (Python scalars and keyword arguments); arrays stay dynamic.
    """

    def wrapper(*args, **kwargs):
        static_pos = tuple(i for i, a in enumerate(args)
                           if a is not None and not hasattr(a, "shape"))
        key = (name, static_pos, tuple(args[i] for i in static_pos),
               tuple(sorted(kwargs.items())))
        jitted = _KERNEL_CACHE.get(key)
        if jitted is None:
            statics = {i: args[i] for i in static_pos}
            n = len(args)

            def call(*dynamic):
                it = iter(dynamic)
                full = [statics[i] if i in statics else next(it) for i in range(n)]
                return fn(*full, **kwargs)

            jitted = _KERNEL_CACHE[key] = jax.jit(call)
        dynamic = [a for i, a in enumerate(args) if i not in static_pos]
        with jax.disable_jit(False):
            return jitted(*dynamic)

    return wrapper


@contextlib.contextmanager
def _op_by_op():
    """``jax.disable_jit()``, with each Pallas kernel entry point compiled once (above).

    The entry points are the module-level ``_*_pallas`` functions of
    ``eagle_jax.kernels``; they are swapped for cached wrappers for the duration of the
    call and restored afterwards (the tool is single-threaded; a lock keeps two eager
    calls from interleaving their swaps).
    """
    import eagle_jax.kernels as kernels_pkg

    with _KERNEL_LOCK:
        saved = []
        for info in pkgutil.iter_modules(kernels_pkg.__path__):
            mod = importlib.import_module(f"{kernels_pkg.__name__}.{info.name}")
            for attr, fn in list(vars(mod).items()):
                if attr.startswith("_") and attr.endswith("_pallas") and callable(fn):
                    saved.append((mod, attr, fn))
                    setattr(mod, attr, _cached_kernel(f"{info.name}.{attr}", fn))
        try:
            with jax.disable_jit():
                yield
        finally:
            for mod, attr, fn in saved:
                setattr(mod, attr, fn)


def _as_jax(args):
    """What jit does to its arguments: numpy / Python scalars become device arrays."""
    return jax.tree.map(lambda x: jnp.asarray(x) if x is not None else None, args,
                        is_leaf=lambda x: x is None)


class _Unjitted:
    """What ``jax.jit(fn, ...)`` gives an EagerEngine: ``fn`` itself, run op by op.

    ``.lower(...)`` and ``.compile()`` return the object, so the engine's
    ``jax.jit(run).lower(...).compile()`` chain works unchanged.
    """

    def __init__(self, fn):
        self.fn = fn

    def lower(self, *args, **kwargs):
        return self

    def compile(self, *args, **kwargs):
        return self

    def __call__(self, *args):
        with _op_by_op():
            return self.fn(*_as_jax(args))


@contextlib.contextmanager
def _intercept_jit(make):
    """While active, ``jax.jit(fn, **kw)`` inside ``eagle_jax.engine.engine`` is
    ``make(fn, **kw)``; every other ``jax`` attribute is the real one."""
    real = engine_module.jax

    class _JaxProxy:
        jit = staticmethod(make)

        def __getattr__(self, name):
            return getattr(real, name)

    with _KERNEL_LOCK:
        engine_module.jax = _JaxProxy()
        try:
            yield
        finally:
            engine_module.jax = real


def _eager_jit(fn, **jit_kwargs):
    del jit_kwargs  # donation and static arguments mean nothing without jit
    return _Unjitted(fn)


class XlaEngine(RecordingMixin, Engine):
    """Mode 1: the served engine, unchanged (jitted, static buffers)."""

    mode = "xla"


class EagerEngine(RecordingMixin, Engine):
    """Mode 2: the same step functions, op by op (``jax.disable_jit``)."""

    mode = "eager"

    def _step_fn(self, batch: int, with_logprobs: bool):
        with _intercept_jit(_eager_jit):
            return super()._step_fn(batch, with_logprobs)

    def _prefill_fn(self, chunk: int):
        with _intercept_jit(_eager_jit):
            return super()._prefill_fn(chunk)

    @functools.cached_property
    def _assign(self):
        with _intercept_jit(_eager_jit):
            return Engine._assign.func(self)

    @functools.cached_property
    def _release(self):
        with _intercept_jit(_eager_jit):
            return Engine._release.func(self)


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


def _flip_last_token(state, out, vocab: int):
    """The last token each row committed (the new last_token) -> (t + 1) mod vocab."""
    last = jnp.maximum(out.num_tokens - 1, 0)
    old = jnp.take_along_axis(out.tokens, last[:, None], axis=1)[:, 0]
    live = out.num_tokens > 0
    new = jnp.where(live, (old + 1) % vocab, old)
    cols = jnp.arange(out.tokens.shape[1])[None]
    tokens = jnp.where((cols == last[:, None]) & live[:, None], new[:, None], out.tokens)
    batch = out.tokens.shape[0]
    last_token = state.last_token.at[:batch].set(
        jnp.where(live, new, state.last_token[:batch]))
    return state._replace(last_token=last_token), out._replace(tokens=tokens)


class PerturbedXlaEngine(XlaEngine):
    """The served engine with a fault in its jitted decode step (``--perturb``).

    ``weight-noise``: inside the jitted decode step, every target parameter is scaled by
    (1 + scale * N(0, 1)) with a fixed key, so the target logits of every decode step
    are off (as a stale or corrupted verify buffer would make them); greedy tokens flip
    wherever the top logits are close. ``flip-token``: the last token each step commits
    (the correction / bonus token, i.e. the new ``last_token``) becomes (t + 1) mod vocab,
    state kept consistent. Prefill is left alone, so the first generated token agrees.
    """

    mode = "xla"

    def __init__(self, *args, perturb: str = "weight-noise", perturb_scale: float = 0.5,
                 **kwargs):
        if perturb not in PERTURB_KINDS or perturb == "none":
            raise ValueError(f"perturb must be one of {PERTURB_KINDS[1:]}, got {perturb!r}")
        self.perturb, self.perturb_scale = perturb, perturb_scale
        super().__init__(*args, **kwargs)

    def _perturbed(self, run):
        perturb, scale = self.perturb, self.perturb_scale

        def wrapped(target_params, draft_params, state, *rest):
            if perturb == "weight-noise":
                target_params = _weight_noise(target_params, scale, jax.random.PRNGKey(1234))
            state, out = run(target_params, draft_params, state, *rest)
            if perturb == "flip-token":
                state, out = _flip_last_token(state, out, self.vocab_size)
            return state, out

        return wrapped

    def _step_fn(self, batch: int, with_logprobs: bool):
        real_jit = jax.jit

        def make(fn, **jit_kwargs):
            return real_jit(self._perturbed(fn), **jit_kwargs)

        with _intercept_jit(make):
            return super()._step_fn(batch, with_logprobs)


def make_engine(mode: str, config, *, tokenizer=None, perturb: str = "none",
                perturb_scale: float = 0.5, draft_probs_hook=None) -> Engine:
    """Builds the engine of one comparison mode: "xla" or "eager"."""
    kw = dict(tokenizer=tokenizer, draft_probs_hook=draft_probs_hook)
    if mode == "xla":
        if perturb != "none":
            return PerturbedXlaEngine(config, perturb=perturb, perturb_scale=perturb_scale, **kw)
        return XlaEngine(config, **kw)
    if mode == "eager":
        return EagerEngine(config, **kw)
    raise ValueError(f"unknown mode {mode!r}")
