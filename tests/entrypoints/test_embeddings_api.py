"""/v1/embeddings, /v1/rerank and Ollama's /api/embed on a real `genserve serve` with three tiny
random models at once (a Qwen3 decoder embedder, a BERT encoder embedder, a BERT cross-encoder),
queried with the official `openai` and `ollama` clients and httpx; results equal to
sentence-transformers, errors as each API sends them."""

from __future__ import annotations

import httpx
import numpy as np
import ollama
import openai
import pytest

from tests.embedding_checkpoints import (
    write_bert_embedder,
    write_bert_reranker,
    write_qwen3_embedder,
)
from tests.serve_process import serve_process

st = pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.slow

TEXTS = ["the cat sat on the mat", "what is the capital of france", "paris", "hello world"]
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the cat sat on a mat", "berlin germany city",
        "a red car"]
PROMPTS = {"query": "instruct: find passages\nquery:", "document": ""}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("served")
    return {"qwen": write_qwen3_embedder(base / "qwen", prompts=PROMPTS),
            "bert": write_bert_embedder(base / "bert"),
            "rerank": write_bert_reranker(base / "rerank")}


@pytest.fixture(scope="module")
def server(folders):
    with serve_process("--model-path", str(folders["qwen"]), "--model-path",
                       str(folders["bert"]), "--model-path", str(folders["rerank"]),
                       "--max-total-tokens", "2048") as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=120)


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())


@pytest.mark.parametrize("name", ["qwen", "bert"])
def test_openai_client_embeddings_equal_sentence_transformers(client, folders, name):
    ref = st.SentenceTransformer(str(folders[name])).encode(TEXTS)
    # The client asks for base64 by default and decodes it; floats are the other encoding.
    got = client.embeddings.create(model=name, input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    assert _cos([d.embedding for d in got.data], ref) >= 0.9999
    assert got.usage.prompt_tokens > len(TEXTS)
    floats = client.embeddings.create(model=name, input=TEXTS[0], encoding_format="float")
    assert _cos([floats.data[0].embedding], ref[:1]) >= 0.9999


def test_instruction_prompt_dimensions_and_token_ids(client, server, folders):
    model = st.SentenceTransformer(str(folders["qwen"]))
    ref = model.encode(TEXTS, prompt_name="query")
    got = client.embeddings.create(model="qwen", input=TEXTS, extra_body={"prompt_name": "query"})
    assert _cos([d.embedding for d in got.data], ref) >= 0.9999
    same = client.embeddings.create(model="qwen", input=TEXTS,
                                    extra_body={"instruction": PROMPTS["query"]})
    assert _cos([d.embedding for d in same.data], ref) >= 0.9999
    short = client.embeddings.create(model="qwen", input=TEXTS, dimensions=32)
    vecs = np.array([d.embedding for d in short.data])
    assert vecs.shape == (len(TEXTS), 32)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    ids = model.tokenizer(TEXTS[0])["input_ids"]
    by_ids = client.embeddings.create(model="qwen", input=[ids])
    assert _cos([by_ids.data[0].embedding], model.encode(TEXTS[:1])) >= 0.9999


def test_rerank_sorted_like_cross_encoder(server, folders):
    ref = st.CrossEncoder(str(folders["rerank"])).predict([(QUERY, d) for d in DOCS])
    r = httpx.post(server + "/v1/rerank", json={
        "model": "rerank", "query": QUERY, "documents": DOCS, "top_n": 3,
        "unknown_field": True}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = [int(i) for i in np.argsort(-ref, kind="stable")]
    assert [x["index"] for x in results] == order[:3]
    for x in results:
        assert abs(x["relevance_score"] - float(ref[x["index"]])) < 1e-5
        assert x["document"]["text"] == DOCS[x["index"]]
    bare = httpx.post(server + "/v1/rerank", json={
        "query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": False})
    assert [x["index"] for x in bare.json()["results"]] == order
    assert "document" not in bare.json()["results"][0]


def test_ollama_client_embed(server, folders):
    ref = st.SentenceTransformer(str(folders["bert"])).encode(TEXTS)
    got = ollama.Client(host=server, timeout=60).embed(model="bert", input=TEXTS)
    assert _cos(got.embeddings, ref) >= 0.9999 and got.prompt_eval_count > 0
    r = httpx.post(server + "/api/embed", json={"model": "rerank", "input": "hello"})
    assert r.status_code == 400 and "reranker" in r.json()["error"]


def test_bad_requests_name_the_problem(client, server):
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model="bert", input=[])
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.embeddings.create(model="bert", input=" ".join(["cat"] * 100))
    with pytest.raises(openai.BadRequestError, match="not a Matryoshka"):
        client.embeddings.create(model="bert", input="cat", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="is a reranker, not an embedding model"):
        client.embeddings.create(model="rerank", input="cat")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="cat")
    r = httpx.post(server + "/v1/rerank", json={"model": "bert", "query": "q", "documents": ["d"]})
    assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/rerank", json={"query": "q", "documents": []})
    assert r.status_code == 400 and "documents" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={
        "model": "qwen", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"]
    assert httpx.get(server + "/health").status_code == 200  # still serving
