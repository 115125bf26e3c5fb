"""Structured output's grammar side: a request's ``StructuredOutput`` compiled for the
tokenizer, and the matcher that says which tokens may come next.

The grammar engine is xgrammar (chosen over llguidance by its per-token mask time on the
default pair's tokenizer: README, "Structured output"). Its masks are token bitmasks:
int32 words [ceil(V / 32)], bit ``t % 32`` of word ``t // 32`` set where token t is
allowed (``kernels.filters.apply_token_bitmask`` applies them in the step).

EOS: the tokenizer's stop ids are the matcher's stop tokens, so the mask allows them
only where the structure is complete, and allows nothing but them once it is.
Compiled grammars are cached by their ``StructuredOutput`` (``GrammarCompiler``).
"""

from __future__ import annotations

import collections
import json
import threading

import numpy as np

from eagle_jax.sampling import StructuredOutput

# Distinct compiled grammars kept (a JSON schema's is tens of KiB).
CACHE_SIZE = 256


def num_mask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over ``vocab_size`` tokens."""
    return -(-vocab_size // 32)


def import_xgrammar():
    """The xgrammar module, imported on first use: it imports torch, which an
    unconstrained server never needs to load. It is the "structured" extra, not a
    dependency (pyproject.toml); a ValueError naming the extra where it is missing."""
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError(f"structured_output: the grammar engine xgrammar is not installed "
                         f"({e}); install it with pip install 'eagle_jax[structured]'"
                         ) from None
    return xgrammar


class GrammarCompiler:
    """Compiles ``StructuredOutput``s for one tokenizer (``eagle_jax.tokenizer.Tokenizer``,
    a Hugging Face ``tokenizers`` tokenizer: byte-level BPE or SentencePiece-style byte
    fallback), keeping the last CACHE_SIZE compiled grammars. Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        if tokenizer is None:
            raise ValueError("structured_output: needs a tokenizer; this model directory has "
                             "none")
        self.vocab_size = int(vocab_size)
        self.stop_ids = sorted(int(i) for i in stop_ids)
        if not self.stop_ids:
            raise ValueError("structured_output: needs an EOS token id (the grammar ends the "
                             "output with it); the model's config and tokenizer name none")
        xgr = import_xgrammar()
        special = set(tokenizer.all_special_ids) | set(self.stop_ids)
        if tokenizer.is_byte_level:
            vocab = [b"" if i in special else tokenizer.token_bytes(i)
                     for i in range(self.vocab_size)]
            kind, prefix_space = xgr.VocabType.RAW, False
        else:  # SentencePiece pieces ("▁" for a space, <0x0A> byte tokens)
            vocab = ["" if i in special else (tokenizer.id_to_token(i) or "")
                     for i in range(self.vocab_size)]
            kind, prefix_space = xgr.VocabType.BYTE_FALLBACK, True
        self._info = xgr.TokenizerInfo(vocab, vocab_type=kind, vocab_size=self.vocab_size,
                                       stop_token_ids=self.stop_ids,
                                       add_prefix_space=prefix_space)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of ``spec`` (cached); a ValueError naming the problem
        for an invalid schema, regex or grammar."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput):
        c = self._compiler
        try:
            if spec.kind == "json":
                json.loads(spec.spec)  # a clearer message than the compiler's
                return c.compile_json_schema(spec.spec, any_whitespace=False)
            if spec.kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "choice":
                return c.compile_grammar(
                    "root ::= " + " | ".join(json.dumps(s) for s in spec.choices))
            return c.compile_grammar(spec.spec)
        except Exception as e:  # xgrammar raises RuntimeError / its own error types
            what = {"json": "JSON schema", "json_object": "JSON object grammar",
                    "regex": "regex", "choice": "choice", "grammar": "grammar"}[spec.kind]
            raise ValueError(f"structured_output: invalid {what}: {e}") from None

    def matcher(self, spec: StructuredOutput) -> "RequestGrammar":
        """A fresh matcher of ``spec`` (compiled, or taken from the cache)."""
        return RequestGrammar(self.compile(spec), self.stop_ids, self.vocab_size)


class RequestGrammar:
    """One request's place in its grammar: advanced by the tokens it commits
    (``advance``), asked for the mask after a tentative continuation (``fill_mask``:
    the step's drafted tokens), which it then takes back."""

    def __init__(self, compiled, stop_ids: list[int], vocab_size: int):
        self._matcher = import_xgrammar().GrammarMatcher(compiled,
                                                         override_stop_tokens=stop_ids)
        self.num_words = num_mask_words(vocab_size)

    @property
    def is_terminated(self) -> bool:
        """Whether it accepted a stop token (the structure is complete and ended)."""
        return self._matcher.is_terminated()

    def advance(self, tokens) -> None:
        """Commits ``tokens``. A token the grammar refuses is a bug of the masking (the
        step samples only allowed tokens): a RuntimeError naming it."""
        for t in tokens:
            if not self._matcher.accept_token(int(t)):
                raise RuntimeError(f"structured output: the grammar refused committed token "
                                   f"{int(t)}: the step's mask was not applied")

    def fill_mask(self, tentative, out: np.ndarray) -> None:
        """``out`` (int32 [num_words]) <- the bitmask after ``tentative`` tokens (not
        committed: rolled back after). Where the grammar refuses one of them, or ended
        before them, the mask allows every token: no verified position past a refused
        draft token can be committed (the target's masked probability of the refused
        token is 0), so its mask is never used."""
        m = self._matcher
        taken = 0
        for t in tentative:
            if m.is_terminated() or not m.accept_token(int(t)):
                break
            taken += 1
        if taken == len(tentative) and not m.is_terminated():
            import torch

            m.fill_next_token_bitmask(torch.from_numpy(out[None]), 0)
        else:
            out[:] = -1
        if taken:
            m.rollback(taken)


def fill_masks(grammars: dict[int, RequestGrammar], tentative: np.ndarray, num_words: int
               ) -> np.ndarray:
    """The bitmasks [B, num_words] int32 of a step's rows: row b's after its tentative
    tokens ``tentative[b]`` ([B, n]) where ``grammars`` has row b, else every token."""
    out = np.full((tentative.shape[0], num_words), -1, np.int32)
    for row, grammar in grammars.items():
        if row < out.shape[0]:
            grammar.fill_mask(tentative[row], out[row])
    return out
