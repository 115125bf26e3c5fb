"""Tokenizer of a Hugging Face checkpoint directory, without ``transformers``.

``Tokenizer.from_dir`` reads ``tokenizer.json`` with the ``tokenizers`` library and the
small JSON side files next to it:

* ``tokenizer_config.json``: special tokens (``bos_token``, ``eos_token``, ``pad_token``,
  ``unk_token``), ``add_bos_token`` / ``add_eos_token``, ``chat_template``,
  ``model_max_length``;
* ``chat_template.jinja`` / ``chat_template.json``: the chat template of newer
  checkpoints (they win over ``tokenizer_config.json``, as in ``transformers``);
* ``generation_config.json`` and ``config.json``: ``eos_token_id`` (an int or a list).

``eos_token_ids`` is the union of every source, the tokenizer config's ``eos_token``
first. Chat templates render with a sandboxed jinja2 environment configured as
``transformers`` configures it (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text).

``token_text`` / ``token_bytes`` give one token's text and raw bytes (the logprob
``token`` and ``bytes`` of the OpenAI API); a byte-level BPE token maps back to its bytes
even when it holds only part of a multi-byte character.

``IncrementalDetokenizer`` turns a growing stream of token ids into text deltas. It
decodes a short window of ids (the offsets algorithm of TGI / vLLM) and holds back text
that ends in U+FFFD, the replacement character a byte-level BPE produces while a
multi-byte character is split across tokens; the concatenated deltas (plus ``flush()``)
equal ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from typing import Any, Iterable, Sequence

import tokenizers

_REPLACEMENT = "\ufffd"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of byte-level BPE: each byte to the printable character that spells it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_BYTE_DECODER = {ch: b for b, ch in _bytes_to_unicode().items()}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token and chat-template metadata."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | dict[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        model_max_length: int | None = None,
        path: str | None = None,
    ):
        self._tok = tokenizer
        self.path = path
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.bos_token_id = self.token_to_id(bos_token) if bos_token is not None else None
        self.eos_token_id = self.token_to_id(eos_token) if eos_token is not None else None
        self.pad_token_id = self.token_to_id(pad_token) if pad_token is not None else None
        self.unk_token_id = self.token_to_id(unk_token) if unk_token is not None else None
        eos: list[int] = []
        for i in ([self.eos_token_id] if self.eos_token_id is not None else []) + list(
            extra_eos_token_ids
        ):
            if i not in eos:
                eos.append(int(i))
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        if self.eos_token_id is None and eos:
            self.eos_token_id = eos[0]
        # Does the tokenizer.json post-processor already add BOS / EOS?
        probe_special = self._tok.encode("a", add_special_tokens=True).ids
        probe_plain = self._tok.encode("a", add_special_tokens=False).ids
        self._post_adds_bos = (
            self.bos_token_id is not None
            and len(probe_special) > len(probe_plain)
            and probe_special[0] == self.bos_token_id
        )
        self._post_adds_eos = (
            self.eos_token_id is not None
            and len(probe_special) > len(probe_plain)
            and probe_special[-1] == self.eos_token_id
        )
        self._compiled_templates: dict[str, Any] = {}
        self._token_texts: dict[int, str] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir_if_present(cls, path: str | os.PathLike) -> "Tokenizer | None":
        """The tokenizer of a checkpoint directory, None where it has no tokenizer.json
        (a model served on token ids alone)."""
        if not os.path.exists(os.path.join(path, "tokenizer.json")):
            return None
        return cls.from_dir(path)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads the tokenizer of a Hugging Face checkpoint directory.

        Raises FileNotFoundError naming the directory or the missing ``tokenizer.json``.
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"tokenizer directory {path!r} does not exist (expected a Hugging Face "
                "checkpoint directory holding tokenizer.json)"
            )
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(
                f"{tok_file} not found: a fast-tokenizer file (tokenizer.json, the format the "
                "`tokenizers` library saves) is required; slow tokenizers "
                "(tokenizer.model / vocab.json + merges.txt alone) are not supported"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(tok_file)
        except Exception as e:  # tokenizers raises a plain Exception
            raise ValueError(f"cannot load {tok_file}: {e}") from e

        cfg_file = os.path.join(path, "tokenizer_config.json")
        cfg = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}

        chat_template: Any = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        json_tpl_file = os.path.join(path, "chat_template.json")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                chat_template = f.read()
        elif os.path.isfile(json_tpl_file):
            chat_template = _read_json(json_tpl_file).get("chat_template", chat_template)
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
            chat_template = {
                d["name"]: d["template"]
                for d in chat_template
                if isinstance(d, dict) and "name" in d and "template" in d
            }

        extra_eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            f = os.path.join(path, name)
            if os.path.isfile(f):
                extra_eos += _id_list(_read_json(f).get("eos_token_id"))

        model_max_length = cfg.get("model_max_length")
        if not isinstance(model_max_length, int) or model_max_length > 1 << 40:
            model_max_length = None  # transformers writes 1e30 for "unset"

        return cls(
            tok,
            bos_token=_token_content(cfg.get("bos_token")),
            eos_token=_token_content(cfg.get("eos_token")),
            pad_token=_token_content(cfg.get("pad_token")),
            unk_token=_token_content(cfg.get("unk_token")),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            chat_template=chat_template,
            extra_eos_token_ids=extra_eos,
            model_max_length=model_max_length,
            path=path,
        )

    # --------------------------------------------------------------- vocabulary
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(hf_tokenizer)``)."""
        return max(
            self._tok.get_vocab_size(with_added_tokens=True),
            max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1,
        )

    def __len__(self) -> int:
        return self.vocab_size

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def all_special_ids(self) -> list[int]:
        ids = {
            i
            for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
            if i is not None
        }
        for i, tok in self._tok.get_added_tokens_decoder().items():
            if tok.special:
                ids.add(i)
        return sorted(ids)

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens:
            if self.add_bos_token and not self._post_adds_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and not self._post_adds_eos and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # -------------------------------------------------------------- one token
    def token_text(self, token_id: int) -> str:
        """The text of one token decoded alone, special tokens kept.

        Cached: logprob formatting asks for the same few thousand tokens over and over.
        Only ids of the vocabulary are cached, so the cache is bounded by its size.
        """
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            if self.id_to_token(token_id) is not None:
                self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token.

        A byte-level BPE piece maps back to its bytes, even when it holds part of a
        multi-byte character (its ``token_text`` is then U+FFFD); special tokens and the
        tokens of other tokenizers are their text in UTF-8.
        """
        piece = self.id_to_token(token_id)
        if piece is not None and self._is_byte_level and token_id not in self._special_ids \
                and all(ch in _BYTE_DECODER for ch in piece):
            return bytes(_BYTE_DECODER[ch] for ch in piece)
        return self.token_text(token_id).encode()

    @property
    def is_byte_level(self) -> bool:
        """Whether its pieces are byte-level BPE's (GPT-2's byte alphabet), so that
        ``token_bytes`` is each token's exact bytes."""
        return self._is_byte_level

    @functools.cached_property
    def _is_byte_level(self) -> bool:
        """Whether the decoder (or one in its sequence) is byte-level BPE's."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
        return "ByteLevel" in kinds

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.all_special_ids)

    # ------------------------------------------------------------ chat template
    def get_chat_template(self, name: str | None = None) -> str:
        tpl = self.chat_template
        if tpl is None:
            raise ValueError(
                f"the tokenizer at {self.path!r} has no chat template (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja): use a completion request "
                "with a plain prompt instead"
            )
        if isinstance(tpl, dict):
            key = name or "default"
            if key not in tpl:
                raise ValueError(f"no chat template named {key!r}; have {sorted(tpl)}")
            return tpl[key]
        return tpl

    def _compile(self, source: str):
        compiled = self._compiled_templates.get(source)
        if compiled is None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ValueError(f"chat template error: {message}")

            def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                return json.dumps(
                    x,
                    ensure_ascii=ensure_ascii,
                    indent=indent,
                    separators=separators,
                    sort_keys=sort_keys,
                )

            def strftime_now(fmt):
                return datetime.datetime.now().strftime(fmt)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = strftime_now
            compiled = env.from_string(source)
            self._compiled_templates[source] = compiled
        return compiled

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        """Renders a conversation to the prompt text (not tokenised).

        ``chat_template`` overrides the tokenizer's template; ``extra`` are passed to the
        template as variables (``tools``, ``enable_thinking`` ...).
        """
        source = chat_template if chat_template is not None else self.get_chat_template()
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
        }
        variables.update(extra)
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        import jinja2

        try:
            return self._compile(source).render(**variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={self.path!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token!r}, eos_ids={self.eos_token_ids})"
        )


class IncrementalDetokenizer:
    """Streams text for a growing sequence of generated token ids.

    ``push(new_ids)`` returns the text the new ids complete. Text that ends in U+FFFD
    (an incomplete UTF-8 sequence of a byte-level BPE) is held back until the next token
    completes it; ``flush()`` returns whatever is still held at the end. With
    ``prompt_ids`` the last few prompt tokens seed the decode window, so decoders that
    treat the first token specially (SentencePiece's leading space) stream the same
    text as when the prompt is decoded with the output.
    """

    _PROMPT_WINDOW = 5

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        window = [int(i) for i in list(prompt_ids or ())[-self._PROMPT_WINDOW :]]
        self._ids: list[int] = list(window)
        self._prefix_offset = 0
        self._read_offset = len(window)
        self._num_prompt = len(window)
        self.output_ids: list[int] = []
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: Iterable[int]) -> str:
        new_ids = [int(i) for i in new_ids]
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.output_ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Returns the held-back text (an incomplete character decodes to U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix_text) :] if full.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
