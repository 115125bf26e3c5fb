"""A tiny byte-level BPE tokenizer for tests, trained on an embedded text.

``write_test_tokenizer(out_dir, vocab_size=512)`` trains a byte-level BPE with the
``tokenizers`` library on ``CORPUS`` (English prose and Python code, a few KB) and
writes ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, a small chat
template) into ``out_dir``. The vocabulary holds exactly ``vocab_size`` entries: the
special tokens first (ids 0..len(SPECIAL_TOKENS)-1), the 256 byte symbols, the learned
merges, and, if the trainer stops early, ``<|extra_N|>`` added tokens as padding.
Training is deterministic and takes well under a second.
"""

from __future__ import annotations

import os

from eagle_jax.bpe import save_hf_tokenizer, train_byte_level_bpe

SPECIAL_TOKENS = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"

# Renders, for [{"role": "user", "content": "Hi"}] with the generation prompt:
#   "<|bos|><|user|>\nHi<|end|>\n<|assistant|>\n"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

CORPUS = '''
The quick brown fox jumps over the lazy dog. A speculative decoding engine drafts a few
tokens with a small model and verifies them with the large model in one forward pass.
When the draft is right, several tokens are committed in a single step; when it is wrong,
the target model's own choice is kept, so the output never changes. The acceptance rate
depends on how well the draft model predicts the target, and on the temperature of the
sampling distribution. Greedy decoding accepts a draft token exactly when it equals the
argmax of the target distribution at that position.

Once upon a time there was a little server that answered questions all day long. It read
each request, counted the tokens of the prompt, and wrote the answer back one piece at a
time. The people who used it were happy, because the answers came quickly and the server
never forgot a request, even when many of them arrived at the same moment.

In the morning the weather was cold and clear. We walked to the station, bought two
tickets, and waited for the train. The children asked questions about the mountains,
the rivers, the animals in the forest and the stars in the sky. Their teacher answered
every question with patience and a smile, and then she asked them what they had learned.

def fibonacci(n: int) -> list[int]:
    """Returns the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Request:
    def __init__(self, request_id: str, prompt: list[int], max_tokens: int = 16):
        self.request_id = request_id
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.output = []

    def is_finished(self) -> bool:
        return len(self.output) >= self.max_tokens


def accept_length(draft: list[int], target: list[int]) -> int:
    count = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        count += 1
    return count


for index in range(10):
    if index % 2 == 0:
        print("even", index)
    else:
        print("odd", index)

import json
import numpy as np

def softmax(x):
    x = np.asarray(x, dtype=np.float32)
    e = np.exp(x - x.max())
    return e / e.sum()

result = {"tokens": [1, 2, 3], "text": "hello world", "finished": True}
print(json.dumps(result, indent=2))

Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 (a + b) * c = d;
x[i] = y[j] + z[k]; {key: value}; <tag>text</tag>; path/to/file.py; user@example.com.
Questions? Answers! Lists: apples, oranges, bananas, pears, grapes and cherries.
'''


def write_test_tokenizer(
    out_dir: str | os.PathLike, vocab_size: int = 512, with_chat_template: bool = True
) -> str:
    """Trains the test tokenizer and saves it into ``out_dir``; returns ``out_dir``.

    ``vocab_size`` must be at least 256 + len(SPECIAL_TOKENS) (the byte alphabet and the
    special tokens).
    """
    out_dir = os.fspath(out_dir)
    tok = train_byte_level_bpe([CORPUS], vocab_size, SPECIAL_TOKENS, min_frequency=1)
    config = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    if with_chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    save_hf_tokenizer(tok, out_dir, config)
    return out_dir
