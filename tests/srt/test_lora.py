"""Multi-LoRA serving: PEFT adapters on a tiny Llama give the tokens of PEFT's merged model,
batched with other adapters and the base model; adapters never share KV; the slot pool evicts
the least recently used adapter; adapters that do not fit the model are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from genserve import Engine
from genserve.srt.lora import layers as lora_layers
from genserve.srt.lora import make_lora_batch
from tests.needs import missing
from tests.srt.hf_equality import TINY, save_tiny
from tests.srt.test_speculative import repetitive

try:
    import peft
except ImportError:  # CI installs it (requirements-torch-nodeps.txt): there this fails
    missing("peft (install it with --no-deps)", module_level=True)

MAX_NEW = 8
PROMPTS = [[1, 17, 42, 99, 3, 250, 8, 19, 77, 5, 6], [1, 5], list(range(3, 40))]
ENGINE = dict(dtype="float32", max_total_tokens=2048, chunked_prefill_size=16)
ADAPTERS = {
    # name: (r, alpha, targets, rslora)
    "all": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"], False),
    "qv": (8, 16, ["q_proj", "v_proj", "down_proj"], True),
}


def _llama(tmp: Path, **sizes) -> Path:
    import transformers as tf

    return save_tiny(tf.LlamaForCausalLM, tf.LlamaConfig(**{**TINY, **sizes}), tmp, seed=3)


def make_adapter(base: Path, out: Path, r: int, alpha: int, targets: list[str],
                 rslora: bool, seed: int) -> Path:
    """A PEFT adapter with random A and B (PEFT starts B at zero: a no-op adapter)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                          lora_dropout=0.0)
    model = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
    model.save_pretrained(out)
    return out


def merged_model(base: Path, adapter: Path | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def hf_greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    inp = torch.tensor([ids])
    out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=MAX_NEW,
                         min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, lps


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    base = _llama(tmp / "base")
    paths = {name: make_adapter(base, tmp / name, *spec, seed=i)
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    refs = {}
    for name in [None, *paths]:
        model = merged_model(base, paths.get(name))  # type: ignore[arg-type]
        refs[name] = [hf_greedy(model, ids) for ids in PROMPTS]
    return base, paths, refs


def _lora_args(paths: dict[str, Path]) -> list[str]:
    return [f"{n}={p}" for n, p in paths.items()]


def test_make_lora_batch_groups_tokens_by_slot():
    b = make_lora_batch([1, -1, 0, 1], [2, 3, 1, 2], torch.device("cpu"))
    assert b is not None and not b.identity
    # Slot 0 owns token 5; slot 1 owns tokens 0-1 and 6-7; the base request's 2-4 are absent.
    assert b.perm.tolist() == [5, 0, 1, 6, 7]
    assert b.segments == [(0, 0, 1), (1, 1, 5)]
    assert make_lora_batch([-1, -1], [1, 1], torch.device("cpu")) is None
    assert make_lora_batch([2, 2], [1, 3], torch.device("cpu")).identity  # type: ignore[union-attr]
    masked = make_lora_batch([1, -1, 0], [2, 1, 1], torch.device("cpu"), num_slots=3)
    assert masked is not None and masked.slot_mask is not None
    # [tokens, slots, 1]: tokens 0-1 use slot 1, token 2 the base model, token 3 slot 0.
    assert masked.slot_mask[:, :, 0].tolist() == [[0, 1, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0]]


@pytest.mark.parametrize("dense_max_tokens", [0, 128], ids=["grouped", "masked"])
def test_mixed_adapters_in_one_batch_equal_peft_merged(lora_setup, monkeypatch,
                                                       dense_max_tokens):
    base, paths, refs = lora_setup
    # Both forms of the LoRA matmuls: grouped by segment, and all slots masked per token.
    monkeypatch.setattr(lora_layers, "DENSE_MAX_TOKENS", dense_max_tokens)
    # The adapters change the model: otherwise the comparison below proves nothing.
    assert refs["all"][0][0] != refs[None][0][0] and refs["qv"][0][0] != refs[None][0][0]
    engine = Engine(str(base), lora_paths=_lora_args(paths), **ENGINE)
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    try:
        for order in (["all", "qv", None], [None, "all", "qv"], ["qv", "qv", "all"]):
            got = engine.generate(input_ids=PROMPTS, sampling_params=sampling,
                                  lora_path=order, return_logprob=True)
            for ids, name, res in zip(PROMPTS, order, got):
                want, want_lp = refs[name][PROMPTS.index(ids)]
                assert res["output_ids"] == want, f"adapter {name}, prompt {ids[:4]}"
                lps = [lp for lp, _ in res["meta_info"]["output_token_logprobs"]]
                assert lps == pytest.approx(want_lp, abs=1e-4)
            engine.check_integrity()
            engine.flush_cache()
    finally:
        engine.shutdown()


def test_adapters_never_share_kv(lora_setup):
    base, paths, refs = lora_setup
    engine = Engine(str(base), lora_paths=_lora_args(paths), **ENGINE)
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    ids = PROMPTS[2]
    try:
        first = engine.generate(input_ids=ids, sampling_params=sampling, lora_path="all")
        assert first["meta_info"]["cached_tokens"] == 0
        for name in ("qv", None):  # same tokens, other weights: nothing cached to reuse
            res = engine.generate(input_ids=ids, sampling_params=sampling, lora_path=name)
            assert res["meta_info"]["cached_tokens"] == 0, name
            assert res["output_ids"] == refs[name][2][0]
            engine.check_integrity()
        again = engine.generate(input_ids=ids, sampling_params=sampling, lora_path="qv")
        assert again["meta_info"]["cached_tokens"] >= len(ids) - 1
        assert again["output_ids"] == refs["qv"][2][0]
        # Reloaded under the same name, an adapter gets a fresh namespace: its old KV is stale.
        engine.unload_lora_adapter("qv")
        engine.load_lora_adapter("qv", str(paths["qv"]))
        res = engine.generate(input_ids=ids, sampling_params=sampling, lora_path="qv")
        assert res["meta_info"]["cached_tokens"] == 0
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_one_slot_evicts_the_least_recently_used_adapter(lora_setup):
    base, paths, refs = lora_setup
    engine = Engine(str(base), lora_paths=_lora_args(paths), max_loaded_loras=1, **ENGINE)
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    try:
        # Both adapters in one call: the second waits until the first's requests finish.
        got = engine.generate(input_ids=PROMPTS, sampling_params=sampling,
                              lora_path=["all", "qv", "all"])
        for i, (name, res) in enumerate(zip(["all", "qv", "all"], got)):
            assert res["output_ids"] == refs[name][i][0]
        info = engine.server_info()["lora"]
        assert info["slot_evictions"] >= 1
        assert info["adapters"]["qv"]["slot"] == 0 and info["adapters"]["all"]["slot"] is None
        assert all(a["pins"] == 0 for a in info["adapters"].values())
        engine.check_integrity()
        # A new adapter loaded at run time takes the slot of the least recently used one.
        engine.load_lora_adapter("third", str(paths["all"]))
        res = engine.generate(input_ids=PROMPTS[0], sampling_params=sampling,
                              lora_path="third")
        assert res["output_ids"] == refs["all"][0][0]
        assert engine.server_info()["lora"]["adapters"]["qv"]["slot"] is None
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_unknown_and_mismatched_adapters_are_refused(lora_setup, tmp_path):
    base, paths, _ = lora_setup
    engine = Engine(str(base), **ENGINE)
    try:
        with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
            engine.generate(input_ids=PROMPTS[0], lora_path="nope")
        # A target module the model does not have.
        bad = tmp_path / "bad_target"
        bad.mkdir()
        for f in paths["qv"].iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((bad / "adapter_config.json").read_text())
        cfg["target_modules"] = ["q_proj", "qkv_mixer"]
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="target module 'qkv_mixer' is not a linear layer"):
            engine.load_lora_adapter("bad", str(bad))
        # An adapter trained for a model of another width.
        other = _llama(tmp_path / "wide", hidden_size=96)
        wide = make_adapter(other, tmp_path / "wide_lora", 4, 8, ["q_proj"], False, seed=9)
        with pytest.raises(ValueError, match=r"maps 96 -> 96 features but the base model's "
                                             r"layer maps 64 -> 64"):
            engine.load_lora_adapter("wide", str(wide))
        # A rank that disagrees with its config.
        cfg = json.loads((paths["all"] / "adapter_config.json").read_text())
        lying = tmp_path / "lying"
        lying.mkdir()
        (lying / "adapter_model.safetensors").write_bytes(
            (paths["all"] / "adapter_model.safetensors").read_bytes())
        (lying / "adapter_config.json").write_text(json.dumps({**cfg, "r": 6}))
        with pytest.raises(ValueError, match="rank 4 .* r=6"):
            engine.load_lora_adapter("lying", str(lying))
        assert engine.server_info()["lora"]["adapters"] == {}
        engine.load_lora_adapter("qv", str(paths["qv"]))
        with pytest.raises(ValueError, match="already loaded"):
            engine.load_lora_adapter("qv", str(paths["qv"]))
        engine.unload_lora_adapter("qv")
        with pytest.raises(ValueError, match="unknown LoRA adapter 'qv'"):
            engine.unload_lora_adapter("qv")
    finally:
        engine.shutdown()


def test_lora_paths_are_checked_at_start(lora_setup):
    base, paths, _ = lora_setup
    with pytest.raises(ValueError, match="NAME=PATH"):
        Engine(str(base), lora_paths=[str(paths["qv"])], **ENGINE)
    with pytest.raises(ValueError, match="not supported with --tp > 1"):
        Engine(str(base), lora_paths=[f"a={paths['qv']}"], tp_size=2, **ENGINE)


def test_speculative_decoding_verifies_under_each_requests_adapter(lora_setup):
    base, paths, refs = lora_setup
    engine = Engine(str(base), lora_paths=_lora_args(paths), speculative_algorithm="ngram",
                    speculative_ngram_min_match_window_size=1, **ENGINE)
    sampling = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    # Prompts that repeat a motif, so n-gram drafts are proposed and verified.
    prompts = [repetitive(i, 30 + 7 * i) for i in range(3)]
    try:
        got = engine.generate(input_ids=prompts, sampling_params=sampling,
                              lora_path=["all", "qv", None])
        plain = Engine(str(base), lora_paths=_lora_args(paths), **ENGINE)
        want = plain.generate(input_ids=prompts, sampling_params=sampling,
                              lora_path=["all", "qv", None])
        plain.shutdown()
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
        stats = engine.server_info()["stats"]
        assert stats["spec_verify_steps"] > 0 and stats["spec_accepted_tokens"] > 0
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_abort_and_retraction_release_adapter_pins(lora_setup):
    from genserve.srt.sampling import SamplingParams
    from genserve.srt.tokenizer_manager import make_tokenized_req

    base, paths, _ = lora_setup
    sampling = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompts = [PROMPTS[0], PROMPTS[2][:20], PROMPTS[0][::-1]]
    loras = ["all", "qv", "all"]
    roomy = Engine(str(base), lora_paths=_lora_args(paths), **ENGINE)
    want = [r["output_ids"] for r in roomy.generate(input_ids=prompts, sampling_params=sampling,
                                                     lora_path=loras)]
    roomy.shutdown()
    # A pool too small for all three: requests are retracted (pins released) and come back.
    engine = Engine(str(base), lora_paths=_lora_args(paths),
                    **{**ENGINE, "max_total_tokens": 96})
    try:
        got = engine.generate(input_ids=prompts, sampling_params=sampling, lora_path=loras)
        assert [r["output_ids"] for r in got] == want
        assert engine.server_info()["stats"]["retractions"] > 0
        engine.check_integrity()
        sched = engine.scheduler
        params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
        sched.add_request(make_tokenized_req(prompts[1], params, rid="x", lora_name="qv"))
        sched.step()
        assert engine.server_info()["lora"]["adapters"]["qv"]["pins"] == 1
        sched.abort("x")
        while sched.has_work():
            sched.step()
        assert engine.server_info()["lora"]["adapters"]["qv"]["pins"] == 0
        engine.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["phi3", "qwen2"])
def test_other_families_equal_peft_merged(family, tmp_path):
    """Phi-3 stores q/k/v and gate/up fused in its checkpoint (PEFT adapts the fused
    qkv_proj and gate_up_proj); Qwen2's q/k/v carry biases."""
    import transformers as tf

    if family == "phi3":
        cfg = tf.Phi3Config(**TINY, tie_word_embeddings=False)
        cls, targets = tf.Phi3ForCausalLM, ["qkv_proj", "gate_up_proj", "o_proj"]
    else:
        cfg = tf.Qwen2Config(**TINY, tie_word_embeddings=False)
        cls, targets = tf.Qwen2ForCausalLM, ["k_proj", "v_proj", "up_proj", "down_proj"]
    base = save_tiny(cls, cfg, tmp_path / "base", seed=5)
    adapter = make_adapter(base, tmp_path / "lora", 4, 8, targets, False, seed=5)
    want = [hf_greedy(merged_model(base, m), ids)[0]
            for m, ids in ((adapter, PROMPTS[0]), (None, PROMPTS[1]), (adapter, PROMPTS[2]))]
    assert want[0] != hf_greedy(merged_model(base, None), PROMPTS[0])[0]
    engine = Engine(str(base), lora_paths=[f"x={adapter}"], **ENGINE)
    sampling = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    try:
        got = engine.generate(input_ids=PROMPTS, sampling_params=sampling,
                              lora_path=["x", None, "x"])
        assert [r["output_ids"] for r in got] == want
        engine.check_integrity()
    finally:
        engine.shutdown()
