"""Evaluation datasets: JSONL prompts (with optional references) or a tree of files.

Formats (``load_dataset(path, tokenizer, ...)``):

* **JSONL** (``*.jsonl``, or any file whose lines are JSON objects): one example per
  line, ``{"prompt": "text" | [token ids], "reference": "text" | [token ids]}``;
  ``reference`` is optional. Blank lines are skipped. A ``*.json`` file holding a list
  of such objects is read the same way.
* **Directory of text / code files**, cut with this fixed rule: every regular file
  under the directory (recursively; names sorted; hidden files and directories and
  files that are not UTF-8 text skipped) is encoded *without* special tokens, and
  split into consecutive, non-overlapping windows of ``prompt_tokens +
  continuation_tokens`` tokens starting at token 0. Window k gives the prompt
  ``ids[k*W : k*W + prompt_tokens]`` and the reference continuation ``ids[k*W +
  prompt_tokens : (k+1)*W]`` (W = prompt_tokens + continuation_tokens). A trailing
  partial window is dropped, so a file shorter than W tokens gives no example;
  ``windows_per_file`` (if set) keeps only the first windows of each file.
* **None**: a small built-in set of English and code prompts (token ids drawn from a
  seeded generator when there is no tokenizer).

``limit`` keeps the first ``limit`` examples, in the order above.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

BUILTIN_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Then",
    "def fibonacci(n: int) -> list[int]:\n",
    "Once upon a time there was a little server that",
    "In the morning the weather was cold and clear. We walked to",
    "import json\nimport numpy as np\n\ndef softmax(x):\n",
    "A speculative decoding engine drafts a few tokens with a small model and",
    "for index in range(10):\n    if index % 2 == 0:\n",
    "The children asked questions about the mountains, the rivers,",
)


@dataclasses.dataclass
class Example:
    """One prompt, as token ids, with an optional reference continuation."""

    prompt_ids: list[int]
    reference_ids: list[int] | None = None
    source: str = ""  # "file.jsonl:LINE" or "path/in/dir#window" or "builtin:i"
    reference_text: str | None = None


class DatasetError(ValueError):
    pass


def _to_ids(value, tokenizer, what: str, where: str, add_special_tokens: bool) -> list[int]:
    if isinstance(value, str):
        if tokenizer is None:
            raise DatasetError(f"{where}: {what} is text but the model has no tokenizer; "
                               "give token ids instead")
        return list(tokenizer.encode(value, add_special_tokens=add_special_tokens))
    if isinstance(value, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [int(t) for t in value]
    raise DatasetError(f"{where}: {what} must be a string or a list of token ids")


def _from_records(records, tokenizer, path: str) -> list[Example]:
    out = []
    for where, rec in records:
        if not isinstance(rec, dict) or "prompt" not in rec:
            raise DatasetError(f"{where}: expected an object with a \"prompt\" field")
        prompt = _to_ids(rec["prompt"], tokenizer, "prompt", where, add_special_tokens=True)
        if not prompt:
            raise DatasetError(f"{where}: the prompt is empty")
        ref = rec.get("reference")
        ref_ids = None
        if ref is not None:
            ref_ids = _to_ids(ref, tokenizer, "reference", where, add_special_tokens=False)
        out.append(Example(prompt, ref_ids, where, ref if isinstance(ref, str) else None))
    return out


def _read_json_records(path: str):
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            data = json.load(f)
            if not isinstance(data, list):
                raise DatasetError(f"{path}: a .json dataset must hold a list of objects")
            return [(f"{path}[{i}]", r) for i, r in enumerate(data)]
        records = []
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        return records


def _text_files(root: str) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if not name.startswith("."):
                files.append(os.path.join(dirpath, name))
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def _windows(root: str, tokenizer, prompt_tokens: int, continuation_tokens: int,
             windows_per_file: int | None) -> list[Example]:
    if tokenizer is None:
        raise DatasetError(f"{root}: a directory dataset needs the model's tokenizer")
    if prompt_tokens < 1 or continuation_tokens < 1:
        raise DatasetError("--prompt-tokens and --continuation-tokens must be >= 1")
    width = prompt_tokens + continuation_tokens
    out = []
    for path in _text_files(root):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not a text file
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        rel = os.path.relpath(path, root)
        for k in range(len(ids) // width):
            if windows_per_file is not None and k >= windows_per_file:
                break
            w = ids[k * width:(k + 1) * width]
            out.append(Example(w[:prompt_tokens], w[prompt_tokens:], f"{rel}#{k}"))
    return out


def _builtin(tokenizer, seed: int, vocab_size: int | None) -> list[Example]:
    if tokenizer is not None:
        return [Example(list(tokenizer.encode(p)), None, f"builtin:{i}")
                for i, p in enumerate(BUILTIN_PROMPTS)]
    rng = np.random.default_rng(seed)
    hi = vocab_size or 256
    return [Example([int(t) for t in rng.integers(1, hi, int(rng.integers(8, 24)))], None,
                    f"builtin:{i}") for i in range(len(BUILTIN_PROMPTS))]


def load_dataset(path: str | None, tokenizer=None, *, prompt_tokens: int = 64,
                 continuation_tokens: int = 32, windows_per_file: int | None = None,
                 limit: int | None = None, seed: int = 0,
                 vocab_size: int | None = None) -> list[Example]:
    """Examples from ``path`` (see the module docstring for the formats)."""
    if path is None:
        examples = _builtin(tokenizer, seed, vocab_size)
    elif os.path.isdir(path):
        examples = _windows(path, tokenizer, prompt_tokens, continuation_tokens,
                            windows_per_file)
    elif os.path.isfile(path):
        examples = _from_records(_read_json_records(path), tokenizer, path)
    else:
        raise DatasetError(f"--dataset {path}: no such file or directory")
    if limit is not None:
        examples = examples[:limit]
    if not examples:
        raise DatasetError(f"--dataset {path}: no examples (a directory needs files of at "
                           f"least {prompt_tokens + continuation_tokens} tokens)")
    return examples


def describe_rule(path: str | None, prompt_tokens: int, continuation_tokens: int,
                  windows_per_file: int | None) -> str:
    if path is None:
        return "built-in prompts"
    if os.path.isdir(path):
        per = "all windows" if windows_per_file is None else f"first {windows_per_file} windows"
        return (f"files under {path}, sorted, encoded without special tokens, cut into "
                f"non-overlapping windows of {prompt_tokens} prompt + {continuation_tokens} "
                f"reference tokens from token 0 ({per} per file, partial windows dropped)")
    return f"JSON records from {path}"
