"""The speculative-decoding engine: jitted steps over static buffers, and the scheduler."""

from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.engine import Engine
from eagle_jax.engine.llm import LLM
from eagle_jax.engine.types import CompletionOutput, RequestOutput, SpecDecodeStats, TokenLogprob

__all__ = ["Engine", "EngineConfig", "LLM", "CompletionOutput", "RequestOutput",
           "SpecDecodeStats", "TokenLogprob"]
