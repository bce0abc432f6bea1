"""Embedders and rerankers equal to sentence-transformers on tiny random checkpoints: a Qwen3
decoder embedder (last-token pooling through the paged scheduler, instruction prompts,
Matryoshka dimensions), encoder embedders (BERT with mean and CLS pooling, XLM-RoBERTa and
ModernBERT with mean pooling) and BERT, XLM-RoBERTa and ModernBERT cross-encoders (the same
scores, so the same order), each through the offline Engine. Every encoder folder is laid out
as its Hub checkpoints are: XLM-R with its SentencePiece Unigram tokenizer and positions after
the padding id, ModernBERT with a byte-level BPE tokenizer, no segment ids and sliding-window
layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genserve.srt.engine import Engine
from genserve.srt.pooling_config import read_pooling_spec
from tests.embedding_checkpoints import (
    write_bert_embedder,
    write_bert_reranker,
    write_modernbert_embedder,
    write_modernbert_reranker,
    write_qwen3_embedder,
    write_xlmr_embedder,
    write_xlmr_reranker,
)

st = pytest.importorskip("sentence_transformers")

TEXTS = ["the cat sat on the mat", "what is the capital of france", "paris",
         "a big red car on a river bank near the mountain", "hello world"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on a mat", "berlin germany city",
        "a red car", "the capital of germany is berlin", "read a book"]
INSTRUCT = {"query": "instruct: find passages\nquery:", "document": ""}


def _cos(ours: list[list[float]], ref: torch.Tensor) -> float:
    return F.cosine_similarity(torch.tensor(ours), ref.float(), dim=-1).min().item()


def _longest_text(tokenizer, limit: int) -> str:
    """Repeated words whose tokens (special tokens included) are as many as fit in `limit`."""
    n = limit
    while len(tokenizer(" ".join(["cat"] * n))["input_ids"]) > limit:
        n -= 1
    assert len(tokenizer(" ".join(["cat"] * n))["input_ids"]) >= limit - 1  # "cat": <= 2 tokens
    return " ".join(["cat"] * n)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("embedders")
    return {"qwen3": write_qwen3_embedder(base / "qwen3", prompts=INSTRUCT),
            "bert-mean": write_bert_embedder(base / "bert-mean", "mean", normalize=True),
            "bert-cls": write_bert_embedder(base / "bert-cls", "cls", normalize=False),
            "bert-rerank": write_bert_reranker(base / "bert-rerank"),
            "xlmr-mean": write_xlmr_embedder(base / "xlmr-mean", "mean", normalize=True),
            "xlmr-rerank": write_xlmr_reranker(base / "xlmr-rerank"),
            "modernbert-mean": write_modernbert_embedder(base / "modernbert-mean", "mean",
                                                         normalize=False),
            "modernbert-rerank": write_modernbert_reranker(base / "modernbert-rerank")}


def test_kind_is_read_from_the_folder(folders):
    kinds = {k: (s.architecture, s.task, s.runtime, s.pooling, s.normalize, s.activation)
             for k, s in ((k, read_pooling_spec(f)) for k, f in folders.items())}
    embed, rerank = ("embed", "encoder"), ("rerank", "encoder", "cls", False, "sigmoid")
    assert kinds == {
        "qwen3": ("Qwen3Model", "embed", "paged", "lasttoken", True, "identity"),
        "bert-mean": ("BertModel", *embed, "mean", True, "identity"),
        "bert-cls": ("BertModel", *embed, "cls", False, "identity"),
        "bert-rerank": ("BertForSequenceClassification", *rerank),
        "xlmr-mean": ("XLMRobertaModel", *embed, "mean", True, "identity"),
        "xlmr-rerank": ("XLMRobertaForSequenceClassification", *rerank),
        "modernbert-mean": ("ModernBertModel", *embed, "mean", False, "identity"),
        "modernbert-rerank": ("ModernBertForSequenceClassification", *rerank)}


def test_qwen3_decoder_embedder_equals_sentence_transformers(folders):
    ref_model = st.SentenceTransformer(str(folders["qwen3"]))
    with Engine(str(folders["qwen3"]), dtype="float32") as engine:
        assert _cos(engine.encode(TEXTS), ref_model.encode(TEXTS, convert_to_tensor=True)) >= 0.9999
        ours = engine.encode(TEXTS, prompt_name="query")
        ref = ref_model.encode(TEXTS, prompt_name="query", convert_to_tensor=True)
        assert _cos(ours, ref) >= 0.9999
        # A second pass hits the prefix cache for all but the last token: same vectors.
        assert _cos(engine.encode(TEXTS, prompt_name="query"), ref) >= 0.9999
        truncated = engine.encode(TEXTS, dimensions=16)
        ref16 = st.SentenceTransformer(str(folders["qwen3"]), truncate_dim=16).encode(
            TEXTS, convert_to_tensor=True, normalize_embeddings=True)
        assert len(truncated[0]) == 16 and _cos(truncated, ref16) >= 0.9999
        assert torch.allclose(torch.tensor(truncated).norm(dim=-1), torch.ones(len(TEXTS)))
        with pytest.raises(ValueError, match="dimensions must be one of"):
            engine.encode(TEXTS, dimensions=17)
        with pytest.raises(ValueError, match="unknown prompt_name"):
            engine.encode(TEXTS, prompt_name="passage")
        with pytest.raises(ValueError, match="embedding / rerank model"):
            engine.generate("the cat", {"max_new_tokens": 2})
        with pytest.raises(ValueError, match="context length"):
            engine.encode(input_ids=[[5] * 200])
        engine.check_integrity()  # every request's KV went back (to the cache or free list)


@pytest.mark.parametrize("name", ["bert-mean", "bert-cls", "xlmr-mean", "modernbert-mean"])
def test_encoder_embedder_equals_sentence_transformers(folders, name):
    ref_model = st.SentenceTransformer(str(folders[name]))
    ref = ref_model.encode(TEXTS, convert_to_tensor=True)
    with Engine(str(folders[name]), dtype="float32") as engine:
        ours = engine.encode(TEXTS)
        assert _cos(ours, ref) >= 0.9999
        if not read_pooling_spec(folders[name]).normalize:  # the raw pooled vectors
            assert torch.allclose(torch.tensor(ours), ref, atol=1e-4)
        # Every folder takes 64 tokens (XLM-R: 66 positions, the first two before the padding
        # id's); the longest input uses the last position rows, batched with a short one.
        assert engine.model_info()["context_length"] == 64
        longest = _longest_text(ref_model.tokenizer, 64)
        pair = [longest, "paris"]
        assert _cos(engine.encode(pair), ref_model.encode(pair, convert_to_tensor=True)) >= 0.9999
        with pytest.raises(ValueError, match="does not support `dimensions`"):
            engine.encode(TEXTS, dimensions=8)
        with pytest.raises(ValueError, match="context length"):
            engine.encode(" ".join(["cat"] * 80))


@pytest.mark.parametrize("name", ["bert-rerank", "xlmr-rerank", "modernbert-rerank"])
def test_cross_encoder_equals_sentence_transformers(folders, name):
    ref = st.CrossEncoder(str(folders[name])).predict([(QUERY, d) for d in DOCS])
    with Engine(str(folders[name]), dtype="float32") as engine:
        ours = engine.rerank(QUERY, DOCS)
        with pytest.raises(ValueError, match="embed needs an embedding model"):
            engine.encode(TEXTS)
    assert torch.allclose(torch.tensor(ours), torch.tensor(ref), atol=1e-5)
    assert min(abs(a - b) for i, a in enumerate(ref) for b in ref[i + 1:]) > 1e-3  # no ties
    assert sorted(range(len(DOCS)), key=lambda i: -ours[i]) == sorted(
        range(len(DOCS)), key=lambda i: -ref[i])
