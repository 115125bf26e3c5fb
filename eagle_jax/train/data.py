"""Training data for EAGLE drafts: a corpus run through the target, cached as .npy chunks.

Pipeline:

1. ``read_corpus``: a directory of text files (every ``*.txt``/``*.md``/other text file, one
   document each, ``*.jsonl`` files read line by line) or one JSONL file whose rows hold
   ``"input_ids"`` (pre-tokenised), ``"text"``, or ``"prompt"`` (+ ``"response"`` /
   ``"completion"``, appended).
2. ``chunk_sequences``: documents tokenised with ``eagle_jax.tokenizer.Tokenizer``,
   concatenated, and cut into fixed-length sequences (the remainder is dropped).
3. ``collect_features``: the target runs over batches of sequences; per sequence the store
   keeps the token ids [T], the features [T, F] (EAGLE-1: the final-norm hidden states;
   EAGLE-3: the concatenated inputs of ``feature_layers``) and the target's top-1 tokens
   [T] (the loss labels). Rows are flushed to ``tokens_XXXXX.npy`` / ``features_XXXXX.npy``
   / ``top_XXXXX.npy`` every ``chunk_sequences`` sequences, so host memory stays bounded
   by one chunk; training reads the chunks through memory maps.
   With ``target_hidden=True`` (soft-label EAGLE-3 training) the store also keeps the
   target's final-norm hidden state [T, H] in bfloat16 (``hidden_XXXXX.npy``) and the
   logsumexp of the target's full-vocabulary logits computed from that bf16 hidden
   [T] float32 (``lse_XXXXX.npy``). The trainer recomputes the target's logits over the
   draft vocabulary as ``hidden @ lm_head[draft ids].T`` (a [Vd, H] slice of the LM head)
   and ``exp(logsumexp(those) - lse)`` is the target probability mass the draft vocabulary
   covers. That is H bf16 values + 4 bytes per position (a third of EAGLE-3's 3H features),
   exact, and cheaper than top-k logprobs for k >= H / 3; meta.json records
   ``"target_hidden": true``.
4. ``build_vocab_map``: EAGLE-3's reduced vocabulary, the ``draft_vocab_size`` most frequent
   target top-1 tokens (the tokens the draft must predict), as ``d2t`` offsets.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst", ".py", ".json")


def _jsonl_docs(path: str) -> Iterator[str | list[int]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e}") from None
            if isinstance(row, str):
                yield row
            elif "input_ids" in row:
                yield [int(t) for t in row["input_ids"]]
            elif "text" in row:
                yield str(row["text"])
            elif "prompt" in row:
                yield str(row["prompt"]) + str(row.get("response", row.get("completion", "")))
            else:
                raise ValueError(f"{path}:{lineno}: a row needs 'input_ids', 'text' or 'prompt'")


def read_corpus(path: str) -> Iterator[str | list[int]]:
    """Documents of a corpus: text (str) or pre-tokenised ids (list[int])."""
    if os.path.isdir(path):
        for root, _, files in sorted(os.walk(path)):
            for name in sorted(files):
                full = os.path.join(root, name)
                if name.endswith(".jsonl"):
                    yield from _jsonl_docs(full)
                elif name.endswith(TEXT_SUFFIXES) or "." not in name:
                    with open(full, encoding="utf-8", errors="replace") as f:
                        yield f.read()
    elif path.endswith(".jsonl"):
        yield from _jsonl_docs(path)
    elif os.path.isfile(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()
    else:
        raise FileNotFoundError(f"corpus {path!r} not found (a directory of text files or a JSONL)")


def chunk_sequences(docs: Iterable[str | list[int]], seq_len: int, tokenizer=None,
                    vocab_size: int | None = None) -> Iterator[np.ndarray]:
    """Tokenises, concatenates and cuts the documents into int32 [seq_len] sequences."""
    buf: list[int] = []
    for doc in docs:
        if isinstance(doc, str):
            if tokenizer is None:
                raise ValueError("a text corpus needs a tokenizer (--tokenizer)")
            ids = tokenizer.encode(doc)
        else:
            ids = doc
        if vocab_size is not None and ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise ValueError(f"token id outside the target vocabulary [0, {vocab_size})")
        buf.extend(ids)
        while len(buf) >= seq_len:
            yield np.asarray(buf[:seq_len], np.int32)
            buf = buf[seq_len:]


def _to_storage(x: np.ndarray) -> np.ndarray:
    """bfloat16 is stored as its uint16 bits (.npy has no bfloat16)."""
    return x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x


class FeatureStore:
    """Chunks of (tokens [n, T] i32, features [n, T, F], top [n, T] i32, and when
    ``has_target_hidden``: target_hidden [n, T, H] bf16, target_lse [n, T] f32) under
    ``root``."""

    def __init__(self, root: str):
        self.root = root
        with open(os.path.join(root, "meta.json")) as f:
            self.meta = json.load(f)
        self.chunk_sizes = list(self.meta["chunks"])
        self.starts = np.cumsum([0] + self.chunk_sizes)
        self._maps: dict[tuple[str, int], np.ndarray] = {}
        self.counts = np.load(os.path.join(root, "top_counts.npy"))

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def seq_len(self) -> int:
        return int(self.meta["seq_len"])

    @property
    def has_target_hidden(self) -> bool:
        """Whether the cache holds the target's final hidden states (soft labels)."""
        return bool(self.meta.get("target_hidden", False))

    def _array(self, what: str, chunk: int) -> np.ndarray:
        key = (what, chunk)
        if key not in self._maps:
            self._maps[key] = np.load(os.path.join(self.root, f"{what}_{chunk:05d}.npy"),
                                      mmap_mode="r")
        return self._maps[key]

    def get(self, indices: Sequence[int], with_target_hidden: bool = False
            ) -> dict[str, np.ndarray]:
        """Sequences by global index: tokens [B, T], features [B, T, F], top [B, T]; with
        ``with_target_hidden`` also target_hidden [B, T, H] bf16 and target_lse [B, T] f32
        (raises ValueError when the cache was collected without them)."""
        if with_target_hidden and not self.has_target_hidden:
            raise ValueError(
                f"feature cache {self.root} has no target hidden states (hidden_*.npy, "
                "lse_*.npy; meta.json 'target_hidden'): it was collected for hard labels. "
                "Soft-label training (label_mode='soft') needs them: delete the cache or "
                "use another --data-dir so that it is collected again")
        files = {"tokens": "tokens", "features": "features", "top": "top"}
        if with_target_hidden:
            files.update(target_hidden="hidden", target_lse="lse")
        out: dict[str, list] = {k: [] for k in files}
        for i in indices:
            c = int(np.searchsorted(self.starts, i, side="right") - 1)
            r = int(i - self.starts[c])
            for key, what in files.items():
                out[key].append(np.asarray(self._array(what, c)[r]))
        res = {k: np.stack(v) for k, v in out.items()}
        if self.meta["feature_dtype"] == "bfloat16":
            res["features"] = res["features"].view(ml_dtypes.bfloat16)
        if with_target_hidden:
            res["target_hidden"] = res["target_hidden"].view(ml_dtypes.bfloat16)
        return res

    @staticmethod
    def matches(root: str, **expect) -> bool:
        path = os.path.join(root, "meta.json")
        if not os.path.exists(path):
            return False
        with open(path) as f:
            meta = json.load(f)
        return all(meta.get(k) == (list(v) if isinstance(v, tuple) else v)
                   for k, v in expect.items())


def collect_features(target, sequences: Iterable[np.ndarray], out_dir: str, *, kind: str,
                     feature_layers: Sequence[int] | None, seq_len: int, batch_size: int = 8,
                     chunk_sequences: int = 256, max_chunk_bytes: int = 1 << 30,
                     max_sequences: int | None = None, progress: bool = True,
                     source: dict | None = None, target_hidden: bool = False) -> FeatureStore:
    """Runs the target over the sequences and writes a ``FeatureStore`` to ``out_dir``.

    kind "EAGLE": features = final-norm hidden states; "EAGLE3": the inputs of
    ``feature_layers`` concatenated. Host memory holds at most one chunk of rows:
    ``chunk_sequences`` sequences or ``max_chunk_bytes`` of features, whichever is first
    (an 8B target's EAGLE-3 features are ~50 MB per 2048-token sequence in bf16).
    ``source`` is recorded in meta.json (the run reuses the cache only when it matches).
    ``target_hidden``: also store the target's final-norm hidden states (bf16) and the
    logsumexp of its logits over them (soft-label training; see the module docstring).
    """
    from flax import nnx

    os.makedirs(out_dir, exist_ok=True)
    aux = tuple(feature_layers or ()) if kind == "EAGLE3" else ()
    graphdef, state = nnx.split(target)

    @jax.jit
    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        out = model(tokens, pos, None, aux_layers=aux)
        feats = out.aux_hidden if aux else out.hidden
        top = jnp.argmax(out.logits, axis=-1).astype(jnp.int32)
        if not target_hidden:
            return feats, top, None, None
        hidden = out.hidden.astype(jnp.bfloat16)  # what the trainer recomputes logits from
        lse = jax.nn.logsumexp(model.logits(hidden), axis=-1).astype(jnp.float32)
        return feats, top, hidden, lse

    vocab = target.config.vocab_size
    counts = np.zeros(vocab, np.int64)
    chunks: list[int] = []
    pending: dict[str, list[np.ndarray]] = {"tokens": [], "features": [], "top": []}
    if target_hidden:
        pending.update(hidden=[], lse=[])
    feature_dtype = None

    def flush():
        if not pending["tokens"]:
            return
        idx = len(chunks)
        for what, rows in pending.items():
            np.save(os.path.join(out_dir, f"{what}_{idx:05d}.npy"),
                    _to_storage(np.concatenate(rows)))
        chunks.append(sum(len(r) for r in pending["tokens"]))
        for rows in pending.values():
            rows.clear()

    def emit(batch: list[np.ndarray]):
        nonlocal feature_dtype
        tokens = np.stack(batch)
        n = len(batch)
        if n < batch_size:  # keep one compiled shape: pad the last batch
            tokens = np.concatenate([tokens, np.zeros((batch_size - n, seq_len), np.int32)])
        feats, top, hidden, lse = jax.device_get(run(state, jnp.asarray(tokens)))
        feats, top = np.asarray(feats)[:n], np.asarray(top)[:n]
        feature_dtype = feats.dtype
        counts[:] += np.bincount(top.reshape(-1), minlength=vocab)[:vocab]
        pending["tokens"].append(tokens[:n])
        pending["features"].append(feats)
        pending["top"].append(top)
        if target_hidden:
            pending["hidden"].append(np.asarray(hidden)[:n])
            pending["lse"].append(np.asarray(lse)[:n])
        if (sum(len(r) for r in pending["tokens"]) >= chunk_sequences
                or sum(r.nbytes for k in ("features", "hidden") for r in pending.get(k, ()))
                >= max_chunk_bytes):
            flush()

    batch: list[np.ndarray] = []
    total = 0
    bar = tqdm(desc="target features", unit="seq", disable=not progress, total=max_sequences)
    for seq in sequences:
        if max_sequences is not None and total >= max_sequences:
            break
        batch.append(seq)
        total += 1
        if len(batch) == batch_size:
            emit(batch)
            bar.update(len(batch))
            batch = []
    if batch:
        emit(batch)
        bar.update(len(batch))
    bar.close()
    flush()
    if total == 0:
        raise ValueError(f"the corpus yields no sequence of {seq_len} tokens")
    np.save(os.path.join(out_dir, "top_counts.npy"), counts)
    meta = dict(kind=kind, feature_layers=list(aux) if aux else None, seq_len=seq_len,
                feature_dim=None, feature_dtype=str(np.dtype(feature_dtype).name),
                num_sequences=total, chunks=chunks, vocab_size=vocab, source=source,
                target_hidden=bool(target_hidden))
    meta["feature_dim"] = int(np.load(os.path.join(out_dir, "features_00000.npy"),
                                      mmap_mode="r").shape[-1])
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return FeatureStore(out_dir)


def build_vocab_map(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """d2t (int64 [Vd]) over the ``draft_vocab_size`` most frequent ids of ``counts``.

    Ties (and never-seen ids, once the seen ones run out) go to the lower id; the chosen
    ids are sorted, so target_id = draft_id + d2t[draft_id] is increasing.
    """
    counts = np.asarray(counts)
    if not 0 < draft_vocab_size <= counts.size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} outside [1, {counts.size}]")
    order = np.argsort(-counts, kind="stable")
    ids = np.sort(order[:draft_vocab_size])
    return (ids - np.arange(draft_vocab_size)).astype(np.int64)


def target_to_draft(d2t: np.ndarray | None, vocab_size: int) -> np.ndarray:
    """int32 [V]: the draft id of each target id, -1 where it is not drafted (t2d's ids)."""
    out = np.full(vocab_size, -1, np.int32)
    if d2t is None:
        return np.arange(vocab_size, dtype=np.int32)
    d2t = np.asarray(d2t)
    out[np.arange(d2t.size) + d2t] = np.arange(d2t.size, dtype=np.int32)
    return out
