"""Tokenizer: loading, round trips, chat templates, EOS sources, incremental detokenizing."""

import json
import os
import random

import pytest

from eagle_jax.testutil.tokenizer import SPECIAL_TOKENS, write_test_tokenizer
from eagle_jax.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "naïve café, Grüße, 日本語のテキスト, emoji 🙂🚀 and Ω≈ç√∫",
    'def f(x: int) -> int:\n    """Doc."""\n    return {"a": [x, x ** 2]}\n\n\tprint(f(3))\n',
    "  leading and trailing spaces  \n\n",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_test_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=512)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def test_vocab_and_special_tokens(tok):
    assert tok.vocab_size == 512 == len(tok)
    assert tok.bos_token_id == tok.token_to_id("<|bos|>") == SPECIAL_TOKENS.index("<|bos|>")
    assert tok.pad_token_id == tok.token_to_id("<|pad|>")
    assert tok.eos_token_ids == (tok.token_to_id("<|eos|>"),)
    assert tok.id_to_token(tok.bos_token_id) == "<|bos|>"
    assert tok.token_to_id("definitely-not-a-token") is None


def test_token_bytes_byte_level(tok):
    text = "Hello café 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    # The 4-byte emoji spans several tokens: a piece of it decodes alone to U+FFFD, yet
    # its bytes are the raw ones.
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1 and "\ufffd" in tok.token_text(emoji[0])
    assert b"".join(tok.token_bytes(i) for i in emoji) == "🙂".encode()
    assert tok.token_text(tok.bos_token_id) == "<|bos|>"
    assert tok.token_bytes(tok.bos_token_id) == b"<|bos|>"  # special: its text


def test_token_bytes_not_byte_level():
    import tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "Ġworld": 2, "é": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    t = Tokenizer(backend)
    # "Ġ" is a letter of this vocabulary, not byte-level BPE's spelling of a space.
    assert t.token_text(2) == "Ġworld" and t.token_bytes(2) == "Ġworld".encode()
    assert t.token_bytes(3) == "é".encode() and t.token_bytes(1) == b"hello"


@pytest.mark.parametrize("vocab_size", [263, 300, 1000, 3000])
def test_exact_vocab_size(tmp_path, vocab_size):
    t = Tokenizer.from_dir(write_test_tokenizer(tmp_path, vocab_size=vocab_size))
    assert t.vocab_size == vocab_size


def test_deterministic(tmp_path):
    a = open(os.path.join(write_test_tokenizer(tmp_path / "a"), "tokenizer.json")).read()
    b = open(os.path.join(write_test_tokenizer(tmp_path / "b"), "tokenizer.json")).read()
    assert a == b


def test_too_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_test_tokenizer(tmp_path, vocab_size=100)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id  # add_bos_token: true, no post-processor
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text


def test_special_tokens_in_text(tok):
    ids = tok.encode("<|user|>\nhi<|end|>", add_special_tokens=False)
    assert ids[0] == tok.token_to_id("<|user|>")
    assert ids[-1] == tok.token_to_id("<|end|>")
    assert tok.decode(ids) == "\nhi"


def test_matches_transformers(tok_dir, tok):
    import transformers
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
    )
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        ids = tok.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    expected = (
        "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n"
        "<|assistant|>\nHello!<|end|>\n<|user|>\n2+2?<|end|>\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(messages) == expected + "<|assistant|>\n"
    with pytest.raises(ValueError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_hf_semantics(tok):
    # trim_blocks / lstrip_blocks, loopcontrols, tojson keeping non-ASCII, extra variables.
    tpl = (
        "{% for m in messages %}\n"
        "    {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{{ m['content'] | tojson }}|{{ flag }}\n"
        "{% endfor %}"
    )
    msgs = [{"role": "user", "content": c} for c in ("é", "b", "c")]
    assert tok.apply_chat_template(msgs, chat_template=tpl, flag=1) == '"é"|1\n"b"|1\n'


def test_chat_template_matches_transformers(tok_dir, tok):
    import transformers
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
    )
    hf.chat_template = tok.chat_template
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Yo"}]
    for gen in (True, False):
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
            msgs, add_generation_prompt=gen, tokenize=False
        )


def test_no_chat_template(tmp_path):
    t = Tokenizer.from_dir(write_test_tokenizer(tmp_path, with_chat_template=False))
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(tmp_path):
    d = write_test_tokenizer(tmp_path)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}")
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]<|eos|>"


def test_eos_ids_from_all_configs(tmp_path):
    d = write_test_tokenizer(tmp_path)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [6, 2, 5]}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"eos_token_id": 4, "bos_token_id": 1}, f)
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == (2, 6, 5, 4)
    assert t.eos_token_id == 2


def test_eos_without_tokenizer_config_token(tmp_path):
    d = write_test_tokenizer(tmp_path)
    cfg_path = os.path.join(d, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    del cfg["eos_token"]
    cfg["bos_token"] = {"content": "<|bos|>", "special": True}  # AddedToken form
    json.dump(cfg, open(cfg_path, "w"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"eos_token_id": 6}, f)
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == (6,)
    assert t.bos_token_id == 1


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "empty")
    bad = tmp_path / "bad"
    write_test_tokenizer(bad)
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(bad)


def test_missing_tokenizer_config_is_allowed(tmp_path):
    d = write_test_tokenizer(tmp_path)
    os.remove(os.path.join(d, "tokenizer_config.json"))
    t = Tokenizer.from_dir(d)
    assert t.bos_token_id is None and t.eos_token_ids == ()
    assert t.decode(t.encode("abc")) == "abc"


def _stream(tok, ids, rng, prompt_ids=None, skip=True):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out.append(detok.push(ids[i : i + n]))
        i += n
    out.append(detok.flush())
    assert detok.text == "".join(out)
    return "".join(out)


@pytest.mark.parametrize("seed", range(20))
def test_incremental_detokenizer_random_streams(tok, seed):
    rng = random.Random(seed)
    vocab = tok.vocab_size
    # Random ids (byte tokens split multi-byte characters, specials sprinkled in) ...
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    for skip in (True, False):
        assert _stream(tok, ids, rng, skip=skip) == tok.decode(ids, skip_special_tokens=skip)
    # ... and encodings of real multilingual text.
    text = "".join(rng.choice(TEXTS[:3]) for _ in range(3))
    ids = tok.encode(text, add_special_tokens=False)
    assert _stream(tok, ids, rng) == text == tok.decode(ids)
    prompt = tok.encode("Prompt: 日本", add_special_tokens=True)
    assert _stream(tok, ids, rng, prompt_ids=prompt) == tok.decode(ids)


def test_incremental_detokenizer_holds_partial_characters(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the 4-byte emoji spans several tokens
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "🙂"
    assert detok.flush() == ""
    assert detok.push([]) == ""
