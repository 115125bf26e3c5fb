"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, as vLLM serves
them: the served model's tokenizer, with the same chat rendering and special-token
defaults as generation (``add_special_tokens`` true for a prompt, false for messages,
whose template writes them)."""

from __future__ import annotations

from .protocol import APIError, DetokenizeRequest, TokenizeRequest
from .serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):

    def tokenize(self, req: TokenizeRequest) -> dict:
        self.model.check(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError.bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            text = self.render_chat(req.messages, req.add_generation_prompt,
                                    req.chat_template_kwargs)
            add_special = False if req.add_special_tokens is None else req.add_special_tokens
        else:
            text = req.prompt
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = self.tokenizer.encode(text, add_special_tokens=add_special)
        return {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids,
                "token_strs": None}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self.model.check(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def tokenizer_info(self) -> dict:
        t = self.tokenizer
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "vocab_size": self.vocab_size,
            "model_max_length": self.model.max_model_len,
            "bos_token": t.bos_token, "bos_token_id": t.bos_token_id,
            "eos_token": t.eos_token, "eos_token_id": t.eos_token_id,
            "eos_token_ids": list(t.eos_token_ids),
            "pad_token": t.pad_token, "pad_token_id": t.pad_token_id,
            "add_bos_token": t.add_bos_token,
            "chat_template": t.chat_template,
        }
