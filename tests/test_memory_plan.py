"""The server's memory plan as arithmetic: device numbers in, KV pools or a refusal out."""

from __future__ import annotations

import pytest

from genserve.memory_plan import (
    GIB,
    DeviceMemory,
    DiffusionDemand,
    LLMDemand,
    MemoryPlanError,
    plan_memory,
)

CARD_80GB = DeviceMemory("cuda:0", 80 * GIB)
# Llama-3-8B's shapes: 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes per token.
LLAMA_8B = LLMDemand("llama-8b", weights_bytes=15 * GIB, kv_bytes_per_token=131072,
                     context_length=131072, activation_bytes=1 * GIB)
FLUX = DiffusionDemand("flux", weights_bytes=32 * GIB, peak_bytes=4 * GIB,
                       peak_source="measured", offloadable_bytes=10 * GIB,
                       call="1024x1024, batch 4")


def test_an_8b_llm_beside_flux_fits_an_80gb_card_with_no_flag():
    plan = plan_memory(CARD_80GB, [LLAMA_8B], [FLUX])
    # 68 GiB share - 15 - 32 - 4 - 1 = 16 GiB of KV: 131072 tokens at 128 KiB each.
    assert plan.kv_budget_bytes == int(80 * GIB * 0.85) - 52 * GIB
    assert plan.pools == {"llama-8b": 131072}  # one full context, a power of two
    assert plan.headroom_bytes == 80 * GIB - 52 * GIB - 16 * GIB
    info = plan.to_dict()
    assert info["llms"][0]["kv_pool_tokens"] == 131072
    assert info["diffusion"][0]["peak_source"] == "measured"
    table = plan.table()
    for label in ("device total", "weights: LLM llama-8b", "weights: diffusion flux",
                  "diffusion peak", "KV pool: llama-8b", "headroom"):
        assert label in table


def test_two_llms_split_by_kv_bytes_times_context():
    small = LLMDemand("small", weights_bytes=GIB, kv_bytes_per_token=32768,
                      context_length=8192)
    big = LLMDemand("big", weights_bytes=GIB, kv_bytes_per_token=131072,
                    context_length=32768)
    device = DeviceMemory("cuda:0", 100 * GIB)
    plan = plan_memory(device, [small, big], fraction=0.5)
    # 48 GiB shared 1 : 16 (32 KiB x 8 K vs 128 KiB x 32 K): each holds the same number of
    # its own full-length requests.
    budget = 48 * GIB
    assert plan.kv_budget_bytes == budget
    share_small = budget * 8192 // (32768 * 8192 + 131072 * 32768)
    share_big = budget * 32768 // (32768 * 8192 + 131072 * 32768)
    assert plan.pools["small"] == 1 << (share_small.bit_length() - 1)
    assert plan.pools["big"] == 1 << (share_big.bit_length() - 1)
    assert plan.pools["big"] // 32768 == plan.pools["small"] // 8192


def test_a_pool_never_rounds_under_the_context_length():
    llm = LLMDemand("m", weights_bytes=0, kv_bytes_per_token=1, context_length=5000)
    plan = plan_memory(DeviceMemory("cuda:0", 7000), [llm], fraction=0.95)
    assert plan.pools["m"] == 5000  # 6650 would round to 4096, under one full context


def test_too_little_memory_is_refused_with_what_would_fit():
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(DeviceMemory("cuda:0", 60 * GIB), [LLAMA_8B], [FLUX])
    text = str(err.value)
    assert "does not fit" in text and "llama-8b (4096 KV tokens)" in text
    # 51 GiB share - 52 GiB committed: offloading 10 GiB of FLUX or dropping either fits.
    assert "--diffusion-offload model" in text
    assert "serving without the LLM llama-8b" in text
    assert "--no-diffusion" in text
    assert "--mem-fraction 0.95" in text  # 57 GiB - 52 GiB leaves room


def test_a_shorter_context_is_offered_when_it_fits():
    llm = LLMDemand("m", weights_bytes=0, kv_bytes_per_token=1024, context_length=8192)
    # 0.85 x 4 MiB holds 3481 tokens: under the 4096 minimum, but a 3328 context fits.
    device = DeviceMemory("cuda:0", 4 * 2**20)
    with pytest.raises(MemoryPlanError, match="What would fit: --context-length 3328[.;]") as err:
        plan_memory(device, [llm])
    assert "--mem-fraction" not in str(err.value)  # 0.95 x 4 MiB is still short


def test_weights_alone_over_the_device_say_so():
    llm = LLMDemand("huge", weights_bytes=200 * GIB, kv_bytes_per_token=1,
                    context_length=8)
    with pytest.raises(MemoryPlanError, match="larger device"):
        plan_memory(CARD_80GB, [llm])


def test_fixed_pools_are_kept_and_checked():
    fixed = LLMDemand("fixed", weights_bytes=GIB, kv_bytes_per_token=1024,
                      context_length=4096, fixed_tokens=2**20)
    plan = plan_memory(DeviceMemory("cuda:0", 10 * GIB), [fixed])
    assert plan.pools == {"fixed": 2**20}
    assert plan.to_dict()["llms"][0]["kv_pool_source"] == "--max-total-tokens"
    with pytest.raises(MemoryPlanError, match="a smaller --max-total-tokens"):
        plan_memory(DeviceMemory("cuda:0", 2 * GIB), [fixed])


def test_a_host_keeps_its_default_pools_unless_they_do_not_fit():
    host = DeviceMemory("cpu", 64 * GIB, free_bytes=40 * GIB)
    smol = LLMDemand("smol", weights_bytes=GIB // 2, kv_bytes_per_token=92160,
                     context_length=8192, default_tokens=32768)
    plan = plan_memory(host, [smol])
    assert plan.pools == {"smol": 32768}
    assert plan.to_dict()["llms"][0]["kv_pool_source"] == "host default"
    # Available memory caps a host plan: 1 GiB free leaves 2**13 tokens, not the default.
    tight = plan_memory(DeviceMemory("cpu", 64 * GIB, free_bytes=GIB), [smol])
    assert tight.pools["smol"] == 8192
    assert tight.to_dict()["llms"][0]["kv_pool_source"] == "planned"


def test_an_encoder_needs_no_pool_and_bad_fractions_are_refused():
    encoder = LLMDemand("bge", weights_bytes=GIB, kv_bytes_per_token=0, context_length=512)
    plan = plan_memory(CARD_80GB, [encoder, LLAMA_8B])
    assert plan.pools["bge"] == 0 and plan.pools["llama-8b"] > 0
    with pytest.raises(ValueError, match="mem-fraction"):
        plan_memory(CARD_80GB, [LLAMA_8B], fraction=0.99)
