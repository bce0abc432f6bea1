"""The smallest models the benchmarks' `--smoke` runs load: a 2-layer random Llama with the
embedded SmolLM2's tokenizer and chat template, so that a smoke run goes through every step a
full run takes (chat template, tokenizer, scheduler, HTTP) in seconds. Its answers are noise:
a smoke run checks the shape of a benchmark's output, never its content or speed."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json", "special_tokens_map.json")


def tiny_chat_model(folder: str | Path | None = None, *, hidden: int = 64, layers: int = 2,
                    seed: int = 0, init_std: float = 0.02) -> Path:
    """Write (once per folder) a random Llama of `layers` layers, `hidden` wide, with SmolLM2's
    vocabulary, tokenizer and chat template; return the folder. Default folder: one under the
    system's temporary directory, reused by later calls.

    init_std: the weights' standard deviation. Tests that compare greedy answers between two
    ways of running the model (one rank and two, speculation and plain decoding) raise it to
    about 0.2: peaky logits leave no near-ties for summation order to flip."""
    std = "" if init_std == 0.02 else f"-std{init_std:g}"
    folder = Path(folder) if folder else Path(tempfile.gettempdir()) / (
        f"genserve-tiny-chat-{hidden}x{layers}-{seed}{std}")
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers as tf

    from genserve.srt.model_loader import resolve_model_folder

    smol = resolve_model_folder(None, dtype="float32")[0]
    vocab = tf.AutoConfig.from_pretrained(smol).vocab_size
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, initializer_range=init_std)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tf.LlamaForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smol / name).is_file():
            shutil.copy(smol / name, tmp / name)
    try:
        tmp.rename(folder)  # atomic: a concurrent writer's folder wins, this one is dropped
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
