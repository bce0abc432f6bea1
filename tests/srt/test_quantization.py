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


def greedy_continuations(ref: Engine, prompts: list[list[int]], new_tokens: int):
    """Each prompt followed by `ref`'s greedy continuation (one batched call)."""
    outs = ref.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": new_tokens})
    return [ids + out["output_ids"] for ids, out in zip(prompts, outs)]


def teacher_forced_metas(engine: Engine, prompts: list[list[int]], seqs: list[list[int]],
                         top: int = 1) -> list[dict]:
    """Each sequence scored by `engine` from its prompt's last token on (its `top` likeliest
    tokens at each position too): the meta_info of each, in order."""
    return [
        engine.generate(
            input_ids=seq,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=len(ids) - 1,
            top_logprobs_num=top,
        )["meta_info"]
        for ids, seq in zip(prompts, seqs)
    ]


def teacher_forced(engine: Engine, prompts: list[list[int]], seqs: list[list[int]]):
    """Score each sequence with `engine`, from its prompt's last token on: per sequence, (the
    top-1 token id at each scored position, the log-prob of each scored token)."""
    return [
        ([t[0][1] for t in m["input_top_logprobs"][1:]],
         [lp for lp, _ in m["input_token_logprobs"][1:]])
        for m in teacher_forced_metas(engine, prompts, seqs)
    ]


def agreement_and_drift(ref_scores, quant_scores) -> tuple[float, float]:
    """(share of scored positions whose top-1 token agrees, mean |log p ref - log p quant|)."""
    agree = total = 0
    drift: list[float] = []
    for (top_a, lp_a), (top_b, lp_b) in zip(ref_scores, quant_scores):
        assert len(top_a) == len(top_b) > 0
        agree += sum(a == b for a, b in zip(top_a, top_b))
        total += len(top_a)
        drift += [abs(a - b) for a, b in zip(lp_a, lp_b)]
    return agree / total, sum(drift) / len(drift)


def top1_agreement(ref: Engine, quant: Engine, prompts: list[list[int]], new_tokens: int):
    """Greedy-continue each prompt with `ref`, then score prompt + continuation with both
    engines: (top-1 agreement, mean |d log p|) as in `agreement_and_drift`."""
    seqs = greedy_continuations(ref, prompts, new_tokens)
    return agreement_and_drift(teacher_forced(ref, prompts, seqs),
                               teacher_forced(quant, prompts, seqs))


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


def test_auto_runs_quantized_ggufs_as_int8wo(tiny):
    engine = Engine(tiny, dtype="float32", max_total_tokens=256)
    model, cpu = engine.runtime.runner.model, torch.device("cpu")
    assert choose_quantization("auto", None, model, cpu).mode == "none"
    # Both precision classes run as int8wo, on every call (no start-up timing decides).
    for source in ("int8", "int4"):
        modes = {choose_quantization("auto", source, model, cpu).mode for _ in range(5)}
        assert modes == {"int8wo"}, (source, modes)


# Plain text and chat-formatted prompts: 12 x 32 scored positions (4 x 24 put one token at
# 1% of the agreement).
SMOL_TEXTS = (
    "The history of the Roman Empire", "def fibonacci(n):", "Water boils at",
    "My favourite book is", "The capital of France is", "In 1969, astronauts",
    "A recipe for pancakes:", "Photosynthesis is the process",
)
SMOL_QUESTIONS = (
    "What is the capital of France?", "Write a haiku about the sea.",
    "How do I sort a list in Python?", "Why is the sky blue?",
)
SMOL_NEW_TOKENS = 32


def smol_prompts(tok) -> list[list[int]]:
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                add_generation_prompt=True)
        for q in SMOL_QUESTIONS
    ]
    return [tok.encode(t) for t in (*SMOL_TEXTS, *chats)]


@pytest.fixture(scope="module")
def smol_ref(smol_reference):
    """The unquantized SmolLM2 (float32): its dtype, the prompts, its greedy continuations and
    its own teacher-forced scores of them (the session's, shared with the default server's
    test in tests/entrypoints/test_default_server.py)."""
    return smol_reference


# int8wo is the mode `--quantization auto` picks for a quantized GGUF: held to the bar and to
# the answer. int4wo (on request only) is held to the agreement bar; it answers the France
# question wrongly ("L'Etoile, ..."), which is why auto does not pick it.
@pytest.mark.parametrize("mode", ["int8wo", "int4wo"])
def test_smollm2_quantized_agrees_and_answers(smol_ref, mode):
    from genserve.srt.model_loader import embedded_gguf_path, gguf_precision_class

    assert gguf_precision_class(embedded_gguf_path()) == "int4"
    _, prompts, seqs, ref_scores = smol_ref
    quant = Engine(dtype="float32", max_total_tokens=8192, quantization=mode, compile=False)
    tok = quant.tokenizer
    agreement, drift = agreement_and_drift(ref_scores, teacher_forced(quant, prompts, seqs))
    print(f"SmolLM2 {mode}: top-1 agreement {agreement:.3f}, mean |d log p| {drift:.4f}")
    assert agreement >= 0.95, agreement
    if mode != "int8wo":
        quant.shutdown()
        return
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    out = quant.generate(chat, {"temperature": 0, "max_new_tokens": 16})
    assert "Paris" in out["text"]
    quant.check_integrity()
    quant.shutdown()
