"""eagle_jax: EAGLE / EAGLE-3 speculative decoding in JAX, with Pallas kernels."""

from eagle_jax.sampling import TOP_K_ALL, SamplingParams, StructuredOutput


def __getattr__(name):
    # The engine pulls in the models and kernels; import it on first use.
    if name in ("LLM", "Engine", "EngineConfig"):
        from eagle_jax import engine

        return getattr(engine, name)
    raise AttributeError(name)


__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "StructuredOutput", "TOP_K_ALL"]
