"""Tiny random-weight embedders and rerankers saved as sentence-transformers folders (the files
a Hub checkpoint carries: modules.json, the pooling config, prompts), for the parity tests, the
server tests and benchmarks/bench_embeddings.py. Each builder is seeded: same folder every time.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("the cat dog sat on mat a red blue green big small house car tree sky sea what is "
         "capital of france paris berlin germany city river mountain book read write code "
         "model embed search query document hello world fast slow").split()


def _bert_tokenizer() -> object:
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS,
             *"abcdefghijklmnopqrstuvwxyz"]
    return BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})


def _bert_config(num_labels: int | None = None, hidden: int = 32, layers: int = 2,
                 init: float = 0.2) -> object:
    from transformers import BertConfig

    extra = {} if num_labels is None else {"num_labels": num_labels}
    return BertConfig(vocab_size=len(WORDS) + 31, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=2, intermediate_size=2 * hidden,
                      max_position_embeddings=64, initializer_range=init, **extra)


def write_bert_embedder(folder: Path, pooling: str = "mean", normalize: bool = True,
                        seed: int = 0, hidden: int = 32, layers: int = 2,
                        matryoshka: bool = False) -> Path:
    """A BERT sentence embedder (`pooling`: mean or cls, optionally normalised)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertModel

    torch.manual_seed(seed)
    raw = folder.parent / f"{folder.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    _bert_tokenizer().save_pretrained(raw)
    BertModel(_bert_config(hidden=hidden, layers=layers)).save_pretrained(raw)
    first = Transformer(str(raw))
    modules = [first, Pooling(first.get_embedding_dimension(), pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules).save(str(folder))
    if matryoshka:
        _patch_config(folder, is_matryoshka=True)
    return folder


def write_bert_reranker(folder: Path, seed: int = 0) -> Path:
    """A BERT cross-encoder (one label, sigmoid scores as sentence-transformers applies)."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    raw = folder.parent / f"{folder.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    _bert_tokenizer().save_pretrained(raw)
    BertForSequenceClassification(_bert_config(num_labels=1)).save_pretrained(raw)
    CrossEncoder(str(raw)).save(str(folder))
    return folder


def write_qwen3_embedder(folder: Path, seed: int = 0, prompts: dict[str, str] | None = None,
                         default_prompt_name: str | None = None) -> Path:
    """A Qwen3-Embedding-style decoder embedder: a bare `Qwen3Model`, a tokenizer that ends
    every input with <|endoftext|>, last-token pooling, Normalize, instruction prompts and
    Matryoshka dimensions."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import Qwen3Config, Qwen3Model

    from genserve.word_tokenizer import word_tokenizer

    torch.manual_seed(seed)
    raw = folder.parent / f"{folder.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    vocab = ["<unk>", "<|endoftext|>", ":", "\n", "instruct", "query", "given", "find",
             "passages", "answer", *WORDS]
    tok = word_tokenizer(vocab, unk="<unk>", split="words-and-marks",
                         template="$A <|endoftext|>", pad_token="<|endoftext|>",
                         eos_token="<|endoftext|>")
    tok.save_pretrained(raw)
    cfg = Qwen3Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=128, initializer_range=0.2,
                      eos_token_id=1, pad_token_id=1)
    Qwen3Model(cfg).save_pretrained(raw)
    first = Transformer(str(raw))
    model = SentenceTransformer(
        modules=[first, Pooling(first.get_embedding_dimension(), "lasttoken"), Normalize()],
        prompts=prompts or {}, default_prompt_name=default_prompt_name)
    model.save(str(folder))
    _patch_config(folder, matryoshka_dimensions=[16, 32, 64])
    return folder


def _patch_config(folder: Path, **fields: object) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg, indent=2))
