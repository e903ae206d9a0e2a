"""Small Llama-architecture models with fixed-seed random weights, for tests, the TTFT bench and
the demo. Nothing is downloaded: a model is a `LlamaConfig` (GQA: fewer KV heads than query heads;
RoPE) plus weights drawn from a seeded generator, so every process that builds (name, seed) gets
bit-identical weights and can share KV through radixkv.

    model = build_model("bench", seed=0)          # LlamaForCausalLM, fp32, eval mode
    path = write_config("/tmp/m", "bench")        # config.json for `radixkv serve --model-config`

Sizes, smallest first: "test" for unit tests, "demo" for the demo's engine stage, "bench" for
TTFT at 2,000 tokens (bench/ttft.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "test": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
    "demo": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 8192},
    # Llama-3-8B's MLP width (14336) against the sequence: attention / MLP FLOPs is
    # 4 x seq / (6 x intermediate) whatever the hidden size, so at 2,000 tokens attention is
    # ~9 % of the MLP as in the real model (measured: ~6 % of this model's prefill). A narrower
    # MLP lets attention, whose masked suffix kernel on CPU costs as much as the full causal
    # one, dominate the reuse ratio. One layer keeps a 2,000-token prefill near 0.7 s.
    "bench": {"hidden_size": 512, "intermediate_size": 14336, "num_hidden_layers": 1,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 32000},
}
_COMMON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "float32"}
# radixkv.engines.attention: sdpa for a full prefill and decoding, prefix + causal suffix merged
# by log-sum-exp for a suffix on cached KV (transformers' "sdpa" and "eager" work too).
ATTN_IMPLEMENTATION = "radixkv"


def config_dict(name: str) -> dict[str, Any]:
    """The config.json contents of model `name` (one of CONFIGS)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(CONFIGS)}")
    return {**_COMMON, **CONFIGS[name]}


def write_config(directory: str | Path, name: str) -> str:
    """Write `config.json` of model `name` into `directory`; returns its path."""
    path = Path(directory) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config_dict(name), indent=2))
    return str(path)


def namespace_for(name: str, seed: int) -> str:
    """A radixkv namespace naming these exact weights: KV is only valid for the same model."""
    digest = hashlib.sha256(json.dumps(config_dict(name), sort_keys=True).encode()).hexdigest()
    return f"tiny-llama-{name}-{digest[:8]}-seed{seed}"


def build_model(name: str = "bench", seed: int = 0,
                attn_implementation: str = ATTN_IMPLEMENTATION) -> Any:
    """A `LlamaForCausalLM` in fp32 eval mode with weights N(0, 0.02) from `seed` (norm weights
    1). Filled in parameter-name order from our own generator, so the weights depend on neither
    transformers' init code nor the global RNG."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixkv.engines import attention

    attention.register()

    config = LlamaConfig(**config_dict(name))
    config._attn_implementation = attn_implementation
    model: Any = LlamaForCausalLM(config)  # fp32 on CPU as built
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model
