"""The LLM benchmarks under benchmarks/ run end to end at a toy size (`--smoke`: a tiny random
model with SmolLM2's tokenizer, 1-2 requests, one round), each in its own process, and print
the summary they would print at full size: these tests check its shape (the rows, the keys, the
kinds of values), never a speed, so that a script cannot break silently between full runs.
The scripts that can measure a running server run against a session-shared one instead
(tests/test_bench_smoke_llm_server.py)."""

from __future__ import annotations

import re

import pytest

from tests.bench_scripts import has_keys, last_json, run_smoke
from tests.needs import missing, smollm2_folder

smollm2_folder(module_level=True)  # the tiny model takes the embedded SmolLM2's tokenizer
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SPREAD_ACROSS_WORKERS = True  # each script runs in its own process; nothing shared


def _compile_restart(out: str) -> None:
    s = last_json(out)
    assert len(s["restart"]) == len(s["restart_genserve_cache_only"]) == 1
    for start in (s["first"], *s["restart"], *s["restart_genserve_cache_only"]):
        has_keys(start, "start_to_healthy_s", "compile_report", "first_token")
        assert 0 < start["start_to_healthy_s"] <= start["start_to_first_token_s"]
        assert start["compile"] is False  # the smoke run is eager


def _decode_step(out: str) -> None:
    s = last_json(out)
    assert (s["quantization"], s["compile"], s["decode_steps"]) == ("none", False, 6)
    assert s["step_ms_median"] >= s["forward_ms_median"] > 0 and s["tok_s"] > 0
    assert len(s["outputs_sha1"]) == 12


def _dp(out: str) -> None:
    s = last_json(out)
    assert s["quantization"] == "none"
    rounds = s["overhead"]["rounds"]
    assert [r["first"] for r in rounds] == ["direct", "router"]  # the order alternates
    assert all(r["direct_tok_s"] > 0 and r["router_tok_s"] > 0 for r in rounds)
    has_keys(s["overhead"], "median_ratio", "ok")
    rates = s["routing"]["hit_rate"]
    assert set(rates) == {"round_robin", "cache_aware"}
    assert all(0 <= r <= 1 for r in rates.values())


def _embeddings(out: str) -> None:
    assert re.search(r"^8 texts, 1 rounds, .* min cosine vs sentence-transformers [\d.]+$",
                     out, re.M), out
    for name in ("genserve", "sentence-transformers"):
        assert re.search(rf"^  {name} +[\d.]+ texts/s \(median of 1\)$", out, re.M), out
    assert re.search(r"^  ratio genserve / sentence-transformers: [\d.]+x$", out, re.M), out


def _lang(out: str) -> None:
    s = last_json(out)
    assert s["quantization"] == "none"
    for side in ("tree_radix", "tree_no_cache"):
        assert len(s[side]["seconds"]) == 1 and s[side]["generated_tokens"] == 2 * 2 + 2 * 2 * 2
    assert s["select"]["picked"] in ("the park", "the bus lines", "the library hours",
                                     "the budget")
    assert s["select"]["prefilled_tokens_lang"] < s["select"]["prefilled_tokens_separate"]
    assert s["tree_speedup"] > 0


def _load(out: str) -> None:
    s = last_json(out)
    assert s["parameters"] > 0 and s["checkpoint_bytes"] > 0
    for loader in ("genserve", "naive"):
        has_keys(s[loader], "baseline_rss", "peak_over_checkpoint", "load_delta_over_checkpoint")
        assert s[loader]["peak_rss"] >= s[loader]["baseline_rss"] > 0


def _lora(out: str) -> None:
    s = last_json(out)
    assert (s["requests"], s["adapters"]) == (16, 4)
    assert s["base_tok_s"] > 0 and s["lora_tok_s"] > 0 and s["ratio"] > 0
    assert re.search(r"^base model x16 +[\d.]+$", out, re.M), out
    assert re.search(r"^4 adapters x 16 +[\d.]+$", out, re.M), out


def _offline(out: str) -> None:
    s = last_json(out)
    assert s["dtype"] == "torch.float32"
    has_keys(s["shared_prefix"], "genserve_tok_per_s", "cache_hit_rate", "hf_s", "speedup")
    assert 0 < s["shared_prefix"]["cache_hit_rate"] <= s["shared_prefix"]["cache_hit_rate_max"]
    has_keys(s["no_sharing"], "radix_on_s", "radix_off_s", "on_vs_off_throughput")
    has_keys(s["decode"], "batch1_decode_tok_per_s", "batch32_decode_tok_per_s", "ratio_32_vs_1")


def _structured(out: str) -> None:
    s = last_json(out)
    ex = s["extraction"]
    for side in ("on", "off"):
        assert ex[side]["valid_outputs"] == 2
        has_keys(ex[side], "requests_per_s", "output_chars_per_s", "forward_passes")
    assert ex["off"]["jump_forward_tokens"] == 0
    assert re.fullmatch(r"[0-2]/2", ex["texts_equal"])
    has_keys(ex, "speedup", "speedup_per_output_char")
    has_keys(s["mask_cost"], "unconstrained_step_ms", "constrained_step_ms", "mask_overhead")
    assert s["compile_cache"] == {"requests": 2, "compiles": 1.0, "cache_hits": 1.0}


def _tp(out: str) -> None:
    s = last_json(out)
    assert s["tp1_tok_s"] > 0 and s["tp2_tok_s"] > 0 and s["tp2_over_tp1"] > 0


def _vlm(out: str) -> None:
    s = last_json(out)
    assert s["requests"] == 2 and s["image"] == "56x56 (4 image tokens)"
    has_keys(s, "genserve_radix_s", "genserve_no_radix_s", "hf_one_by_one_s", "radix_vs_hf")
    assert s["images_encoded_radix"] == s["images_encoded_no_radix"] == 1
    assert isinstance(s["tokens_equal_hf"], bool)


def _verify_step(out: str) -> None:
    s = last_json(out)
    assert (s["quantization"], s["compile"]) == ("none", False)
    assert (s["verify_tokens"], s["iters"]) == (5, 3)
    assert s["verify_ms_median"] > 0 and s["decode_ms_median"] > 0
    assert len(s["verify_argmax_sha1"]) == 12
    # The verify laid out as decode rows reads the same logits in float32.
    assert s["verify_rows_ms_median"] > 0
    assert s["verify_rows_argmax_sha1"] == s["verify_argmax_sha1"]


SCRIPTS = {
    "bench_compile_restart": ((), _compile_restart),
    "bench_decode_step": ((), _decode_step),
    "bench_dp": ((), _dp),
    "bench_embeddings": ((), _embeddings),
    "bench_lang": ((), _lang),
    "bench_load": (("--json",), _load),
    "bench_lora": ((), _lora),
    "bench_offline": ((), _offline),
    "bench_structured": ((), _structured),
    "bench_tp": ((), _tp),
    "bench_verify_step": (("--rows",), _verify_step),
    "bench_vlm": ((), _vlm),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_smoke_run_prints_its_summary(script):
    args, check = SCRIPTS[script]
    if script == "bench_dp":
        from genserve.entrypoints.data_parallel import router_available

        if not router_available():
            missing("sglang-router")
    check(run_smoke(script, *args))
