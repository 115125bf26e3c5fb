"""The speculative-decoding engine: jitted steps over static buffers, and the scheduler."""

from eagle_jax.engine.config import EngineConfig
from eagle_jax.engine.engine import Engine
from eagle_jax.engine.data_parallel import DataParallelEngine, make_engine
from eagle_jax.engine.llm import LLM
from eagle_jax.engine.types import CompletionOutput, RequestOutput, SpecDecodeStats, TokenLogprob

__all__ = ["Engine", "DataParallelEngine", "EngineConfig", "make_engine", "LLM",
           "CompletionOutput", "RequestOutput",
           "SpecDecodeStats", "TokenLogprob"]
