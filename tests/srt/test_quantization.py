"""Weight-only quantization (int8wo / int4wo via torchao) against the unquantized model:
teacher-forced greedy top-1 agreement and log-prob drift, on tiny models and on SmolLM2, with
the KV pool and the radix cache checked after quantized runs."""

from __future__ import annotations

import pytest
import torch

from genserve import Engine
from genserve.srt.layers.quantization import WeightOnlyLinear, choose_quantization
from tests.srt.test_engine import prompt

GREEDY = {"temperature": 0, "ignore_eos": True}


def top1_agreement(ref: Engine, quant: Engine, prompts: list[list[int]], new_tokens: int):
    """Greedy-continue each prompt with `ref`, then score prompt + continuation with both
    engines: (share of positions whose top-1 token agrees, mean |log p ref - log p quant| of the
    scored tokens)."""
    agree = total = 0
    drift: list[float] = []
    for ids in prompts:
        cont = ref.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": new_tokens})
        seq = ids + cont["output_ids"]
        metas = [
            e.generate(
                input_ids=seq,
                sampling_params={"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=len(ids) - 1,
                top_logprobs_num=1,
            )["meta_info"]
            for e in (ref, quant)
        ]
        for a, b in zip(metas[0]["input_top_logprobs"][1:], metas[1]["input_top_logprobs"][1:]):
            agree += a[0][1] == b[0][1]
            total += 1
        for (la, _), (lb, _) in zip(
            metas[0]["input_token_logprobs"][1:], metas[1]["input_token_logprobs"][1:]
        ):
            drift.append(abs(la - lb))
    return agree / total, sum(drift) / len(drift)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.mark.parametrize("mode", ["int8wo", "int4wo"])
def test_quantized_linear_is_close(mode):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96, bias=True)
    x = torch.randn(5, 256)
    ref = linear(x)
    with torch.no_grad():
        out = WeightOnlyLinear(linear, mode)(x)
    assert out.dtype == x.dtype and out.shape == ref.shape
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < (0.02 if mode == "int8wo" else 0.12), rel


def test_tiny_int8wo_tracks_unquantized(tiny):
    mode = "int8wo"
    ref = Engine(tiny, dtype="float32", max_total_tokens=4096)
    quant = Engine(tiny, dtype="float32", max_total_tokens=4096, quantization=mode, compile=False)
    assert quant.model_info()["quantization"] == mode
    linears = [m for m in quant.runtime.runner.model.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and lm_head
    prompts = [prompt(i, 24) for i in range(4)]
    agreement, drift = top1_agreement(ref, quant, prompts, 16)
    print(f"{mode}: top-1 agreement {agreement:.3f}, mean |d log p| {drift:.4f}")
    # A random 2-layer model has many near-ties; SmolLM2 below is held to 95%.
    assert agreement >= 0.9, agreement
    assert drift < 0.1, drift
    quant.check_integrity()


def test_quantized_prefix_cache_hits_give_the_same_tokens(tiny):
    engine = Engine(
        tiny, dtype="float32", max_total_tokens=4096, quantization="int8wo", compile=False
    )
    ids = prompt(7, 40)
    first = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 12})
    again = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 12})
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == first["output_ids"]
    batch = engine.generate(
        input_ids=[ids, ids[:30] + [5, 6, 7]], sampling_params={**GREEDY, "max_new_tokens": 12}
    )
    assert batch[0]["output_ids"] == first["output_ids"]
    engine.check_integrity()
    assert engine.server_info()["quantization"] == "int8wo"


def test_unrunnable_mode_is_a_clear_error(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=256)
    model = engine.runtime.runner.model
    model.model_bad = torch.nn.Linear(40, 8)  # 40 is no multiple of any int4 group size
    with pytest.raises(ValueError, match="int4wo.*divisible by 32.*none or int8wo"):
        choose_quantization("int4wo", None, model, torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(tiny, quantization="int3")


def test_auto_keeps_the_source_precision_class(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=256)
    model, cpu = engine.runtime.runner.model, torch.device("cpu")
    assert choose_quantization("auto", None, model, cpu).mode == "none"
    assert choose_quantization("auto", "int8", model, cpu).mode == "int8wo"
    # A 4-bit source runs as int4wo, or int8wo where int4 was not clearly faster (said why).
    choice = choose_quantization("auto", "int4", model, cpu)
    assert choice.mode == "int4wo" or "not measured clearly faster" in choice.reason


@pytest.fixture(scope="module")
def smol_ref():
    engine = Engine(dtype="float32", max_total_tokens=4096)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("mode", ["int8wo"])
def test_smollm2_quantized_agrees_and_answers(smol_ref, mode):
    from genserve.srt.model_loader import embedded_gguf_path, gguf_precision_class

    assert gguf_precision_class(embedded_gguf_path()) == "int4"
    ref = smol_ref
    quant = Engine(dtype="float32", max_total_tokens=4096, quantization=mode, compile=False)
    tok = quant.tokenizer
    prompts = [
        tok.encode(t)
        for t in (
            "The history of the Roman Empire",
            "def fibonacci(n):",
            "Water boils at",
            "My favourite book is",
        )
    ]
    agreement, drift = top1_agreement(ref, quant, prompts, 24)
    print(f"SmolLM2 {mode}: top-1 agreement {agreement:.3f}, mean |d log p| {drift:.4f}")
    assert agreement >= 0.95, agreement
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    out = quant.generate(chat, {"temperature": 0, "max_new_tokens": 16})
    assert "Paris" in out["text"]
    quant.check_integrity()
    quant.shutdown()
