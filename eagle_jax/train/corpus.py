"""A pre-tokenised Python-source corpus for training the embedded default model pair.

``build_corpus(roots, out_dir)`` (CLI: ``scripts/build_corpus.py``):

1. collects every ``*.py`` file under the roots (``site-packages``, ``dist-packages`` and
   ``__pycache__`` directories are skipped; so are files over ``max_file_bytes`` and files
   that do not decode as UTF-8), keyed by its path relative to its root (with the root's
   base name in front when there are several roots), in sorted order;
2. splits BY FILE: a file is held out iff ``int(sha1(key)[:8], 16) % heldout_every == 0``
   (a fixed rule: the same key is always on the same side, whatever else is collected);
   ``train_files.txt`` / ``heldout_files.txt`` list the keys;
3. trains a byte-level BPE (``tokenizers``) on the TRAIN files only: special tokens
   ``<|endoftext|>`` (id 0, EOS and BOS), ``<|pad|>`` and the chat tokens ``<|system|>``,
   ``<|user|>``, ``<|assistant|>``, ``<|end|>``; the vocabulary is padded with
   ``<|extra_N|>`` tokens when the trainer stops short of ``vocab_size``;
4. writes ``tokenizer.json`` + ``tokenizer_config.json`` and the pre-tokenised corpora
   ``train.npy`` / ``heldout.npy`` (uint16): ``<|endoftext|> file <|endoftext|> file ...
   <|endoftext|>``, every file preceded and the last one followed by EOS;
5. writes ``corpus.json`` (roots, counts, token totals, skipped files).

Everything is deterministic: same files, same outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Sequence

import numpy as np

from eagle_jax.bpe import save_hf_tokenizer, train_byte_level_bpe

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN) + CHAT_TOKENS
SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")

# The model is a Python-code model: it never saw chat markup, so the template renders a
# conversation as the text the model knows: the start-of-file token, then every
# message's content on its own line(s). A prompt "def fibonacci(n):" continues as code.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ message['content'] }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
)


def is_heldout(key: str, heldout_every: int) -> bool:
    """The split rule: held out iff the first 8 hex digits of sha1(key) are 0 mod n."""
    if heldout_every <= 0:
        return False
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) % heldout_every == 0


def collect_files(roots: Sequence[str], max_file_bytes: int = 200_000
                  ) -> tuple[list[tuple[str, str]], list[dict]]:
    """([(key, text)] sorted by key, [{"path", "reason"}] skipped)."""
    files: dict[str, str] = {}
    skipped: list[dict] = []
    multi = len(roots) > 1
    for root in roots:
        root = os.path.abspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"corpus root {root} is not a directory")
        prefix = os.path.basename(root.rstrip(os.sep)) + "/" if multi else ""
        for dirpath, dirnames, names in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in sorted(names):
                if not name.endswith(".py"):
                    continue
                full = os.path.join(dirpath, name)
                if not os.path.isfile(full):
                    continue
                key = prefix + os.path.relpath(full, root).replace(os.sep, "/")
                size = os.path.getsize(full)
                if size > max_file_bytes:
                    skipped.append(dict(path=key, reason=f"{size} bytes > {max_file_bytes}"))
                    continue
                try:
                    with open(full, "rb") as f:
                        text = f.read().decode("utf-8")
                except UnicodeDecodeError:
                    skipped.append(dict(path=key, reason="not UTF-8"))
                    continue
                if not text.strip():
                    skipped.append(dict(path=key, reason="empty"))
                    continue
                if key in files:
                    skipped.append(dict(path=key, reason="duplicate key"))
                    continue
                files[key] = text
    return sorted(files.items()), skipped


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str):
    """Trains the corpus's byte-level BPE on ``texts`` and writes the tokenizer files."""
    if vocab_size > 65536:
        raise ValueError(f"vocab_size must be <= 65536 (uint16 ids), got {vocab_size}")
    tok = train_byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS)
    assert tok.token_to_id(EOS_TOKEN) == 0
    save_hf_tokenizer(tok, out_dir, {
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    })
    return tok


def tokenize_files(tok, texts: Sequence[str], desc: str, progress: bool = True,
                   batch: int = 64) -> np.ndarray:
    """uint16 ids: EOS, file, EOS, file, ..., EOS."""
    from tqdm.auto import tqdm

    eos = tok.token_to_id(EOS_TOKEN)
    parts = [np.asarray([eos], np.uint16)]
    with tqdm(total=len(texts), desc=desc, unit="file", disable=not progress) as bar:
        for i in range(0, len(texts), batch):
            for enc in tok.encode_batch(list(texts[i:i + batch]), add_special_tokens=False):
                parts.append(np.asarray(enc.ids, np.uint16))
                parts.append(np.asarray([eos], np.uint16))
            bar.update(min(batch, len(texts) - i))
    return np.concatenate(parts)


def build_corpus(roots: Sequence[str], out_dir: str, *, vocab_size: int = 8192,
                 heldout_every: int = 20, max_file_bytes: int = 200_000,
                 progress: bool = True) -> dict:
    """Builds the corpus directory (see the module docstring); returns corpus.json's dict."""
    os.makedirs(out_dir, exist_ok=True)
    files, skipped = collect_files(roots, max_file_bytes)
    train = [(k, t) for k, t in files if not is_heldout(k, heldout_every)]
    held = [(k, t) for k, t in files if is_heldout(k, heldout_every)]
    if not train:
        raise ValueError(f"no training files under {list(roots)}")
    for name, part in (("train_files.txt", train), ("heldout_files.txt", held)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.writelines(k + "\n" for k, _ in part)
    tok = train_tokenizer((t for _, t in train), vocab_size, out_dir)
    train_ids = tokenize_files(tok, [t for _, t in train], "tokenize train", progress)
    held_ids = tokenize_files(tok, [t for _, t in held], "tokenize held-out", progress)
    np.save(os.path.join(out_dir, "train.npy"), train_ids)
    np.save(os.path.join(out_dir, "heldout.npy"), held_ids)
    info = dict(
        roots=[os.path.abspath(r) for r in roots], vocab_size=vocab_size,
        heldout_every=heldout_every, max_file_bytes=max_file_bytes,
        split_rule="held out iff int(sha1(key).hexdigest()[:8], 16) % heldout_every == 0",
        train_files=len(train), heldout_files=len(held),
        train_bytes=sum(len(t.encode()) for _, t in train),
        heldout_bytes=sum(len(t.encode()) for _, t in held),
        train_tokens=int(train_ids.size), heldout_tokens=int(held_ids.size),
        eos_token_id=0, skipped=skipped)
    info["bytes_per_token"] = round(info["train_bytes"] / max(info["train_tokens"], 1), 3)
    with open(os.path.join(out_dir, "corpus.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def write_ids_jsonl(npy_path: str, out_path: str, *, row_tokens: int = 4096,
                    max_tokens: int | None = None) -> int:
    """Rows ``{"input_ids": [...]}`` of ``row_tokens`` consecutive ids of a corpus array
    (the draft trainer's pre-tokenised JSONL input); returns the number of rows."""
    ids = np.load(npy_path, mmap_mode="r")
    n = ids.size if max_tokens is None else min(ids.size, max_tokens)
    rows = 0
    with open(out_path, "w") as f:
        for start in range(0, n, row_tokens):
            chunk = np.asarray(ids[start:min(start + row_tokens, n)], np.int64)
            f.write(json.dumps({"input_ids": chunk.tolist()}) + "\n")
            rows += 1
    return rows
