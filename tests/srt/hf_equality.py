"""The check every model family's test runs: genserve's greedy tokens equal HF transformers'
on a tiny random-weight checkpoint, batched, through chunked prefill and on a prefix-cache hit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from genserve import Engine

# Different lengths in one batch; the longest spans several 16-token prefill chunks.
PROMPTS = [
    [1, 17, 42, 99, 3, 250, 8, 19, 77, 5, 6],
    [1, 5],
    list(range(3, 60)),
]
MAX_NEW_TOKENS = 10
# The triton attention backend with the triton norm and rotary kernels (under Triton's
# interpreter on a CPU).
TRITON = dict(attention_backend="triton", norm_kernel="triton", rotary_kernel="triton")
# What every tiny config shares: 2 layers, hidden 64, GQA.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def gemma2_config(**tiny: Any) -> Any:
    """Gemma 2 with what sets it apart: layer 0 slides over 8 tokens, layer 1 sees everything;
    both cap attention logits at 1 and the final logits at 3 (low caps, so that the tanh bends
    the random model's scores). `tiny` overrides TINY's sizes."""
    import transformers as tf

    return tf.Gemma2Config(
        **{**TINY, **tiny},
        head_dim=16,
        tie_word_embeddings=False,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=3.0,
    )


def gemma3_text_config(**tiny: Any) -> Any:
    """Gemma 3 text: local layer 0 (8-token window, theta 10k) and global layer 1 (theta 1M,
    linear scaling), per-head q/k norms with (1 + w). `tiny` overrides TINY's sizes."""
    import transformers as tf

    return tf.Gemma3TextConfig(
        **{**TINY, **tiny},
        head_dim=16,
        tie_word_embeddings=False,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        },
    )


def save_tiny(model_cls: type, config: Any, path: Path, seed: int = 0) -> Path:
    """Save a random-weight HF model (safetensors) built from `config`."""
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Peaky logits (greedy ties would make the comparison flaky); norms and biases too,
            # so a mis-applied norm offset or a dropped bias changes the tokens.
            if p.dim() >= 2:
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.normal_(0, 0.3).add_(1.0 if _plain_norm(model) else 0.0)
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _plain_norm(model) -> bool:
    # Gemma's norms scale by (1 + w): their weights sit around zero.
    return "gemma" not in type(model).__name__.lower()


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    inp = torch.tensor([ids])
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def assert_greedy_matches_hf(path: Path, **engine_kwargs: Any) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kwargs = dict(dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    kwargs.update(engine_kwargs)
    engine = Engine(str(path), **kwargs)
    sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        got = engine.generate(input_ids=PROMPTS, sampling_params=sampling)
        for ids, res in zip(PROMPTS, got):
            want = hf_greedy(hf, ids, MAX_NEW_TOKENS)
            # A random model that repeats one token would make the comparison toothless.
            assert len(set(want)) >= 3, f"degenerate reference output {want}; reseed the model"
            assert res["output_ids"] == want, f"prompt {ids[:5]}"
        engine.check_integrity()
        # A follow-up that extends the longest prompt and its answer: it prefills on top of
        # the radix cache's copy of that prefix.
        follow = PROMPTS[2] + got[2]["output_ids"] + [9, 8, 7]
        res = engine.generate(input_ids=[follow], sampling_params=sampling)[0]
        assert res["meta_info"]["cached_tokens"] >= len(PROMPTS[2])
        assert res["output_ids"] == hf_greedy(hf, follow, MAX_NEW_TOKENS)
        engine.check_integrity()
    finally:
        engine.shutdown()
