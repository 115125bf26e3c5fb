"""The wire schema of the OpenAI-compatible API: request models, their conversion to
``SamplingParams``, the error type and body, and the JSON form of a logprob.

Requests are pydantic models that ignore unknown fields, as vLLM's do. A field the server
cannot take is a 400 ``APIError`` naming the field in ``param``; every error has the
OpenAI / vLLM body ``{"object": "error", "error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ..sampling import SamplingParams
from .structured import StructuredOutputError, structured_output

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

_NEG_INF_LOGPROB = -9999.0  # what vLLM reports for -inf: JSON has no infinity


# ---------------------------------------------------------------------- errors
class APIError(Exception):
    """An HTTP error with the OpenAI / vLLM error body; ``code`` defaults to the status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: Any = None,
                 err_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = status if code is None else code
        self.err_type = err_type or _ERROR_TYPES.get(status, "APIError")

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> "APIError":
        return cls(400, message, param)

    @classmethod
    def from_value_error(cls, error: ValueError) -> "APIError":
        """A 400 for a validation message of SamplingParams or the engine; those begin with
        the field they reject (``temperature must be ...``), which becomes ``param``."""
        message = str(error)
        field = re.match(r"^([a-z_]+) ", message)
        return cls.bad_request(message, field.group(1) if field else None)

    def body(self) -> dict:
        return {
            "object": "error",
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.code,
            },
        }


def parse_request(model_cls: type[BaseModel], data: dict) -> Any:
    """Validates a JSON body into ``model_cls``; the first problem is a 400 naming its field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        loc = [str(x) for x in e.get("loc", ())]
        raise APIError.bad_request(
            f"{'.'.join(loc)}: {e.get('msg')} (got {e.get('input')!r:.200})",
            loc[0] if loc else None)


# -------------------------------------------------------------- request models
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat share: the model, sampling and streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprob tokens as "token_id:N"
    # Structured output (``structured.py``): OpenAI's, vLLM's, and vLLM's older fields.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None,
                           sample_index: int) -> SamplingParams:
        """The engine's parameters for one choice. Sample ``i`` of a seeded request uses
        ``seed + i``, so the n samples differ and each is reproducible alone."""
        try:
            structured = structured_output(
                self.response_format, self.structured_outputs,
                {"json": self.guided_json, "regex": self.guided_regex,
                 "choice": self.guided_choice, "grammar": self.guided_grammar})
        except StructuredOutputError as e:
            raise APIError.bad_request(str(e), e.param)
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=None if self.seed is None else self.seed + sample_index,
                max_tokens=max_tokens,
                stop=self.stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured=structured,
            )
        except ValueError as e:
            raise APIError.from_value_error(e)


Prompt = Union[StrictStr, list[StrictInt], list[list[StrictInt]], list[StrictStr]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    # OpenAI's default when the field is absent; an explicit null runs to the context limit.
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as a chat template reads them: content as one string (text parts
    joined by newlines, None as ""), extra fields kept."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=False)
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    raise APIError.bad_request(
                        f"messages[{i}].content: only text parts are supported, "
                        f"got type {part.get('type')!r}", "messages")
            content = "\n".join(texts)
        d["content"] = "" if content is None else content
        out.append(d)
    return out


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


# ------------------------------------------------------------------ logprobs
def json_logprob(x: float | None) -> float:
    """A logprob as JSON can carry it: -inf, NaN and None become vLLM's -9999.0."""
    if x is None or math.isnan(x):
        return _NEG_INF_LOGPROB
    return max(float(x), _NEG_INF_LOGPROB)
