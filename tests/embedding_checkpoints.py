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


def _xlmr_tokenizer() -> object:
    """XLM-R's own tokenizer class over a small SentencePiece Unigram vocabulary laid out as the
    real one is (<s> <pad> </s> <unk>, the pieces, <mask> last). A few words of the tests have
    no piece of their own, so they split into "▁" and letters, as rare words do."""
    from transformers import XLMRobertaTokenizer

    whole = [w for w in WORDS if w not in ("mountain", "search", "germany")]
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0),
              *((f"\u2581{w}", -5.0) for w in whole), ("\u2581", -6.0),
              *((c, -8.0) for c in "abcdefghijklmnopqrstuvwxyz"), ("<mask>", 0.0)]
    return XLMRobertaTokenizer(vocab=pieces, model_max_length=64)


def _xlmr_config(num_labels: int | None = None) -> object:
    from transformers import XLMRobertaConfig

    extra = {} if num_labels is None else {"num_labels": num_labels}
    # Positions start after the padding id, as in the real checkpoints (514 = 512 + 2): 64 tokens.
    return XLMRobertaConfig(vocab_size=len(_xlmr_tokenizer()), hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=66, type_vocab_size=1, pad_token_id=1,
                            bos_token_id=0, eos_token_id=2, initializer_range=0.2, **extra)


# The class ModernBERT's Hub tokenizer_config.json names (transformers 5 saves its new name).
_MODERNBERT_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def _modernbert_tokenizer() -> object:
    """A byte-level BPE trained here on WORDS, with ModernBERT's special tokens, templates and
    model inputs (no token_type_ids), as its `PreTrainedTokenizerFast` folder has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Fewer merges than words: the longer words stay split into several pieces.
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + 256 + 60, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        pad_token="[PAD]", mask_token="[MASK]", model_max_length=64,
        model_input_names=["input_ids", "attention_mask"])


def _modernbert_config(num_labels: int | None = None) -> object:
    from transformers import ModernBertConfig

    # classifier_pooling "mean": the reranker's head pools over the attention mask too.
    extra = {} if num_labels is None else {"num_labels": num_labels,
                                           "classifier_pooling": "mean"}
    # A local window of 8 tokens on every second layer: most test inputs are longer than that.
    return ModernBertConfig(vocab_size=len(_modernbert_tokenizer()), hidden_size=32,
                            num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=64, global_attn_every_n_layers=2,
                            local_attention=8, pad_token_id=3, bos_token_id=1, eos_token_id=2,
                            cls_token_id=1, sep_token_id=2, initializer_range=0.2, **extra)


def _save_embedder(folder: Path, tokenizer: object, model: object, pooling: str,
                   normalize: bool) -> Path:
    """`model` and `tokenizer` saved as transformers saves them, then wrapped in a
    sentence-transformers folder (Transformer, Pooling and optionally Normalize modules)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    raw = folder.parent / f"{folder.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(raw)  # type: ignore[attr-defined]
    model.save_pretrained(raw)  # type: ignore[attr-defined]
    first = Transformer(str(raw))
    modules = [first, Pooling(first.get_embedding_dimension(), pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules).save(str(folder))
    return folder


def _save_reranker(folder: Path, tokenizer: object, model: object) -> Path:
    """A `*ForSequenceClassification` model saved as a sentence-transformers `CrossEncoder`."""
    from sentence_transformers import CrossEncoder

    raw = folder.parent / f"{folder.name}-raw"
    raw.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(raw)  # type: ignore[attr-defined]
    model.save_pretrained(raw)  # type: ignore[attr-defined]
    CrossEncoder(str(raw)).save(str(folder))
    return folder


def write_bert_embedder(folder: Path, pooling: str = "mean", normalize: bool = True,
                        seed: int = 0, hidden: int = 32, layers: int = 2,
                        matryoshka: bool = False) -> Path:
    """A BERT sentence embedder (`pooling`: mean or cls, optionally normalised)."""
    import torch
    from transformers import BertModel

    torch.manual_seed(seed)
    model = BertModel(_bert_config(hidden=hidden, layers=layers))
    _save_embedder(folder, _bert_tokenizer(), model, pooling, normalize)
    if matryoshka:
        _patch_config(folder, is_matryoshka=True)
    return folder


def write_bert_reranker(folder: Path, seed: int = 0) -> Path:
    """A BERT cross-encoder (one label, sigmoid scores as sentence-transformers applies)."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    model = BertForSequenceClassification(_bert_config(num_labels=1))
    return _save_reranker(folder, _bert_tokenizer(), model)


def write_xlmr_embedder(folder: Path, pooling: str = "mean", normalize: bool = True,
                        seed: int = 0) -> Path:
    """An XLM-RoBERTa sentence embedder (multilingual-e5 style: mean pooling, Normalize)."""
    import torch
    from transformers import XLMRobertaModel

    torch.manual_seed(seed)
    return _save_embedder(folder, _xlmr_tokenizer(), XLMRobertaModel(_xlmr_config()), pooling,
                          normalize)


def write_xlmr_reranker(folder: Path, seed: int = 0) -> Path:
    """An XLM-RoBERTa cross-encoder (bge-reranker-v2-m3 style: one label, sigmoid scores)."""
    import torch
    from transformers import XLMRobertaForSequenceClassification

    torch.manual_seed(seed)
    model = XLMRobertaForSequenceClassification(_xlmr_config(num_labels=1))
    return _save_reranker(folder, _xlmr_tokenizer(), model)


def write_modernbert_embedder(folder: Path, pooling: str = "mean", normalize: bool = True,
                              seed: int = 0) -> Path:
    """A ModernBERT sentence embedder (alternating global and sliding-window attention)."""
    import torch
    from transformers import ModernBertModel

    torch.manual_seed(seed)
    _save_embedder(folder, _modernbert_tokenizer(), ModernBertModel(_modernbert_config()),
                   pooling, normalize)
    _patch_config(folder, "tokenizer_config.json", tokenizer_class=_MODERNBERT_TOKENIZER_CLASS)
    return folder


def write_modernbert_reranker(folder: Path, seed: int = 0) -> Path:
    """A ModernBERT cross-encoder (one label, sigmoid scores, mean-pooled classifier head)."""
    import torch
    from transformers import ModernBertForSequenceClassification

    torch.manual_seed(seed)
    model = ModernBertForSequenceClassification(_modernbert_config(num_labels=1))
    _save_reranker(folder, _modernbert_tokenizer(), model)
    _patch_config(folder, "tokenizer_config.json", tokenizer_class=_MODERNBERT_TOKENIZER_CLASS)
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


def _patch_config(folder: Path, name: str = "config.json", **fields: object) -> None:
    path = folder / name
    cfg = json.loads(path.read_text())
    cfg.update(fields)
    path.write_text(json.dumps(cfg, indent=2))
