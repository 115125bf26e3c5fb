"""Tiny random Hugging Face checkpoints written by transformers, for tests.

Nothing is downloaded: transformers builds a randomly initialised model from a config and
saves it as safetensors, exactly as a published checkpoint is laid out.
"""

from __future__ import annotations

import os

ARCH_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama3": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64)),
    "llama_tied": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                       tie_word_embeddings=True),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
}


def tiny_config(arch: str = "llama", *, vocab_size: int = 256, hidden_size: int = 64,
                num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                intermediate_size: int = 128, max_position_embeddings: int = 512,
                eos_token_id: int | None = None, **overrides) -> dict:
    cfg = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32",
        bos_token_id=None, eos_token_id=eos_token_id, hidden_act="silu",
    )
    cfg.update(ARCH_CONFIGS[arch])
    cfg.update(overrides)
    return cfg


def write_tiny_target(out_dir: str, arch: str = "llama", *, seed: int = 0, init_std: float = 0.1,
                      **config_kwargs) -> str:
    """Writes a random ``arch`` checkpoint with transformers; returns ``out_dir``.

    ``init_std`` is larger than the usual 0.02 so that tiny random models have peaked,
    non-degenerate next-token distributions (greedy ties would make parity tests moot).
    """
    import torch
    import transformers

    cfg_dict = tiny_config(arch, **config_kwargs)
    config_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"]).__class__
    kwargs = {k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")}
    config = config_cls(**kwargs)
    config.architectures = cfg_dict["architectures"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, init_std)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)  # non-trivial norm weights catch a missing norm
            else:
                p.normal_(0.0, init_std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
