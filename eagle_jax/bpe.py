"""A byte-level BPE trained with the ``tokenizers`` library, saved as Hugging Face
tokenizer files (``tokenizer.json`` + ``tokenizer_config.json``, which
``eagle_jax.tokenizer`` and ``transformers`` read).

Shared by the corpus of the default model (``eagle_jax.train.corpus``) and the tiny test
tokenizer (``eagle_jax.testutil.tokenizer``); it lives beside ``tokenizer.py`` rather
than under ``train/`` so that the test helpers need nothing from training.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str],
                         *, min_frequency: int = 2):
    """A byte-level BPE (GPT-2 pre-tokenisation, no prefix space) trained on ``texts``,
    with ``special_tokens`` first (ids 0..) and padded with ``<|extra_i|>`` special tokens
    to exactly ``vocab_size`` ids. Returns a ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    minimum = 256 + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be >= {minimum} (256 byte symbols + "
                         f"{len(special_tokens)} special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    size = tok.get_vocab_size(with_added_tokens=True)
    extra = [f"<|extra_{i}|>" for i in range(vocab_size - size)]
    if extra:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def save_hf_tokenizer(tok, out_dir: str, config: dict) -> None:
    """Writes ``tokenizer.json`` and a ``tokenizer_config.json`` (PreTrainedTokenizerFast,
    every added token in ``added_tokens_decoder``, then ``config``'s entries)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(i): dict(content=t.content, lstrip=False, normalized=False, rstrip=False,
                     single_word=False, special=True)
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    full = {"tokenizer_class": "PreTrainedTokenizerFast", **config, "added_tokens_decoder": added}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(full, f, indent=2, ensure_ascii=False)
        f.write("\n")
