"""Multi-LoRA over HTTP on the embedded SmolLM2: the official openai client selects an adapter
by model name (its own or BASE:NAME), /v1/models lists it under its parent, the native
/generate takes SGLang's lora_path, and /load_lora_adapter and /unload_lora_adapter change what
is served at run time; unknown and unfitting adapters get a 400 / 404 naming them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from genserve.bench.gateway_thread import GatewayThread
from genserve.entrypoints.app import create_app
from genserve.entrypoints.config import GatewayConfig
from genserve.entrypoints.serve import import_async_engine
from genserve.srt.server_args import EngineArgs
from tests.needs import smollm2_folder

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def write_adapter(folder: Path, base: Path, seed: int, targets=("q_proj", "v_proj"),
                  in_features: int | None = None) -> Path:
    """A PEFT adapter folder for the base model in `base` (random A and B, rank 4)."""
    from safetensors.torch import save_file

    cfg = json.loads((base / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = hidden // heads
    out = {"q_proj": hidden, "k_proj": cfg["num_key_value_heads"] * head_dim,
           "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for t in targets:
            key = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, in_features or hidden,
                                                          generator=gen) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(out[t], 4, generator=gen) * 0.3
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": list(targets),
        "bias": "none"}))
    return folder


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    smollm2_folder(module_level=True)
    from genserve.srt.model_loader import resolve_model_folder

    base = resolve_model_folder(None)[0]
    tmp = tmp_path_factory.mktemp("lora-http")
    first = write_adapter(tmp / "first", base, seed=1)
    second = write_adapter(tmp / "second", base, seed=2)
    bad = write_adapter(tmp / "bad", base, seed=3, targets=("q_proj",), in_features=96)
    AsyncEngine = import_async_engine()

    async def build(runtimes):
        engine = AsyncEngine(EngineArgs(max_total_tokens=4096, dtype="float32",
                                        lora_paths=(f"first={first}",), max_loaded_loras=1))
        runtimes.append(engine)
        return create_app(GatewayConfig(), [engine])

    with GatewayThread(build) as live:
        yield live.url, second, bad


def _chat(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def test_openai_client_selects_adapters_and_runtime_load_unload(lora_server):
    url, second, bad = lora_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert models["first"].model_extra["parent"] == MODEL
    base_text = _chat(client, MODEL)
    first_text = _chat(client, "first")
    assert first_text != base_text  # the adapter changes the answer
    assert _chat(client, f"{MODEL}:first") == first_text
    native = httpx.post(f"{url}/generate", json={
        "text": PROMPT, "lora_path": "first",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}, timeout=60).json()
    assert native["text"] == first_text
    with pytest.raises(openai.NotFoundError, match="second"):
        _chat(client, "second")
    r = httpx.post(f"{url}/generate", json={"text": PROMPT, "lora_path": "second"}, timeout=60)
    assert r.status_code == 400 and "Unknown LoRA adapter 'second'" in r.json()["error"]["message"]

    r = httpx.post(f"{url}/load_lora_adapter",
                   json={"lora_name": "second", "lora_path": str(second)}, timeout=60)
    assert r.status_code == 200, r.text
    assert set(r.json()["loaded_adapters"]) == {"first", "second"}
    second_text = _chat(client, "second")
    assert second_text not in (first_text, base_text)
    assert _chat(client, "first") == first_text  # back in the one slot, same answer
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    assert info["lora"]["slot_evictions"] >= 2
    assert info["available_tokens"] + info["cache"]["total_tokens"] == info["max_total_tokens"]

    r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)},
                   timeout=60)
    assert r.status_code == 400 and "maps 96 -> 576 features" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "second"}, timeout=60)
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"first"}
    assert "second" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        _chat(client, "second")
