"""EAGLE speculation (`--speculative-algorithm eagle`) with heads the tests write in the
EAGLE-1/2 on-disk layout (config.json with `LlamaForCausalLMEagle`, safetensors without a
`model.` prefix, the target's embedding and lm_head shared): greedy output equals plain
decoding (batched, a logprobs request riding along plainly, a prefix-cache hit, chunked
prefills with staggered arrivals, abort, retraction), a head built to agree with its target
gets its drafts accepted, and bad heads are refused at start-up, naming the flag."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from genserve import Engine
from genserve.srt.sampling import SamplingParams
from genserve.srt.speculative.eagle import EagleState
from genserve.srt.tokenizer_manager import RequestState, make_tokenized_req
from tests.srt.test_speculative import UnmeasuredCost, repetitive

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def write_eagle_head(folder: Path, target: Path, *, seed: int = 0, agree: bool = False,
                     hidden: int | None = None, vocab: int | None = None) -> Path:
    """An EAGLE-1/2 head for `target` (one decoder layer). agree: fc passes the token's
    embedding through and the layer adds nothing, so the head's logits are lm_head(embed(t)),
    which is what a target with silent layers (`silent_target`) predicts."""
    cfg = json.loads((target / "config.json").read_text())
    h = hidden or cfg["hidden_size"]
    inter, heads, kv = cfg["intermediate_size"], cfg["num_attention_heads"], cfg[
        "num_key_value_heads"]
    d = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    w = {
        "fc.weight": rand(h, 2 * h),
        "fc.bias": rand(h),
        "layers.0.self_attn.q_proj.weight": rand(heads * d, h),
        "layers.0.self_attn.k_proj.weight": rand(kv * d, h),
        "layers.0.self_attn.v_proj.weight": rand(kv * d, h),
        "layers.0.self_attn.o_proj.weight": rand(h, heads * d),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    if agree:
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        w["fc.bias"] = torch.zeros(h)
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
    folder.mkdir(parents=True, exist_ok=True)
    head_cfg = {**cfg, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1,
                "hidden_size": h, "vocab_size": vocab or cfg["vocab_size"],
                "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(head_cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    return folder


def silent_target(folder: Path, target: Path) -> Path:
    """`target` with every attention and MLP output zeroed and a unit final norm: its next
    token depends on the current one alone (argmax lm_head(embed(t)))."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(target / "config.json", folder / "config.json")
    w = load_file(str(target / "model.safetensors"))
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    w["model.norm.weight"] = torch.ones_like(w["model.norm.weight"])
    save_file(w, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return Path(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def head(tiny, tmp_path_factory):
    return str(write_eagle_head(tmp_path_factory.mktemp("eagle-random"), tiny))


def eagle_engine(target: str | Path, head: str | Path, **kw) -> Engine:
    engine = Engine(str(target), dtype="float32",
                    max_total_tokens=kw.pop("max_total_tokens", 4096),
                    speculative_algorithm="eagle", speculative_draft_model_path=str(head), **kw)
    engine.scheduler.spec.cost = UnmeasuredCost()
    return engine


def run_checked(engine: Engine, reqs: list, stagger: int = 0, abort: str | None = None) -> list:
    """Run tokenized requests through the scheduler, checking every pool after each step;
    the second half arrives `stagger` steps after the first; `abort` is aborted at step 3."""
    sched = engine.scheduler
    states = {r.rid: RequestState(r) for r in reqs}
    half = len(reqs) // 2 if stagger else len(reqs)
    for r in reqs[:half]:
        assert sched.add_request(r) is None
    steps = 0
    while sched.has_work() or steps < stagger:
        if steps == stagger:
            for r in reqs[half:]:
                sched.add_request(r)
        if steps == 3 and abort is not None:
            sched.abort(abort)
        for out in sched.step():
            states[out.rid].update(out)
        steps += 1
        sched.check_integrity()
        for req in sched.running:  # head entries only where the target has KV
            if isinstance(req.spec_state, EagleState):
                assert req.spec_state.done <= req.kv_len
    return [states[r.rid].last for r in reqs]


def batch(prompts: list[list[int]], logprob_index: int = -1, prefix: str = "r") -> list:
    return [make_tokenized_req(p, SamplingParams.from_dict(GREEDY), rid=f"{prefix}{i}",
                               return_logprob=i == logprob_index)
            for i, p in enumerate(prompts)]


def test_greedy_output_equals_plain_decoding(tiny, head):
    """A random head: its drafts are mostly wrong, and verification keeps the output."""
    warm = repetitive(50, 40)
    prompts = [repetitive(i, 12 + 11 * i) for i in range(5)]
    prompts.append(warm + [7, 8, 9])  # hits the prefix cache left by the warm-up request
    plain = Engine(str(tiny), dtype="float32", max_total_tokens=4096)
    plain.generate(input_ids=warm, sampling_params=GREEDY)
    want = run_checked(plain, batch(prompts, logprob_index=2))

    engine = eagle_engine(tiny, head, speculative_num_steps=3)
    engine.generate(input_ids=warm, sampling_params=GREEDY)
    got = run_checked(engine, batch(prompts, logprob_index=2))
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    assert engine.scheduler.stats["spec_verify_steps"] > 0
    assert not engine.scheduler.spec.feats  # every finished request's features are gone
    engine.check_integrity()


def reference_drafts(target: Path, head: Path, prompt: list[int], first: int,
                     steps: int) -> list[int]:
    """The head's greedy drafts after `prompt` (whose next token is `first`), computed with
    Hugging Face's Llama modules as EAGLE defines the head: entry i reads token i + 1 and the
    target's normed last hidden state f_i; a draft entry reads the head's own last output."""
    import transformers as tf
    from transformers.models.llama import modeling_llama as hf

    model = tf.LlamaForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    cfg = tf.LlamaConfig(**json.loads((head / "config.json").read_text()))
    cfg._attn_implementation = "eager"
    layer = hf.LlamaDecoderLayer(cfg, 0).eval()
    w = load_file(str(head / "model.safetensors"))
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in w.items()
                           if k.startswith("layers.0.")}, strict=False)
    layer.input_layernorm = torch.nn.Identity()
    rotary = hf.LlamaRotaryEmbedding(cfg)
    embed, lm_head = model.model.embed_tokens, model.lm_head
    with torch.no_grad():
        feats = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
        tokens, drafts = prompt[1:] + [first], []
        for _ in range(steps):
            n = len(tokens)
            x = torch.cat([embed(torch.tensor(tokens)), feats], dim=-1)
            h = (x @ w["fc.weight"].T + w["fc.bias"])[None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(h, attention_mask=mask, position_ids=pos,
                        position_embeddings=rotary(h, pos))
            out = out[0] if isinstance(out, tuple) else out
            drafts.append(int(lm_head(out[0, -1]).argmax()))
            tokens.append(drafts[-1])
            feats = torch.cat([feats, out[0, -1:]])
    return drafts


def test_drafts_follow_the_eagle_definition(tiny, head):
    """The proposer's first drafts after a prefill equal an independent implementation's."""
    prompt = repetitive(7, 23)
    engine = eagle_engine(tiny, head, speculative_num_steps=4)
    sched = engine.scheduler
    sched.add_request(batch([prompt])[0])
    sched.step()  # the prefill: the target's features of every prompt token are captured
    (req,) = sched.running
    drafts = sched.spec.drafts([req], sched.context_length)
    assert drafts[0] == reference_drafts(tiny, Path(head), prompt, req.output_ids[0], 4)


def test_an_agreeing_head_gets_its_drafts_accepted(tiny, tmp_path):
    """A target whose next token depends on the current one and a head that computes the
    same: its drafts are accepted, through chunked prefills and staggered arrivals."""
    target = silent_target(tmp_path / "silent", tiny)
    agreeing = write_eagle_head(tmp_path / "agree", target, agree=True)
    prompts = [repetitive(60 + i, 20 + 15 * i) for i in range(4)]
    plain = Engine(str(target), dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    want = run_checked(plain, batch(prompts), stagger=4)
    engine = eagle_engine(target, agreeing, chunked_prefill_size=16, speculative_num_steps=4)
    got = run_checked(engine, batch(prompts), stagger=4)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    stats = engine.scheduler.stats
    assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_draft_tokens"] > 0
    assert stats["decode_steps"] < stats["generated_tokens"] / 2
    engine.check_integrity()


def test_abort_and_retraction_lose_nothing(tiny, head):
    prompts = [repetitive(100 + i, 40) for i in range(7)]
    params = {**GREEDY, "max_new_tokens": 60}
    tight = eagle_engine(tiny, head, max_total_tokens=300, max_running_requests=8)
    outs = tight.generate(input_ids=prompts, sampling_params=params)
    assert tight.scheduler.stats["retractions"] > 0
    plain = Engine(str(tiny), dtype="float32", max_total_tokens=4096, disable_radix_cache=True)
    want = plain.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [w["output_ids"] for w in want]
    tight.check_integrity()

    engine = eagle_engine(tiny, head)
    got = run_checked(engine, batch(prompts[:3], prefix="a"), abort="a1")
    assert got[1].finish_reason["type"] == "abort"
    assert not engine.scheduler.spec.feats
    want = run_checked(Engine(str(tiny), dtype="float32", max_total_tokens=4096),
                       batch(prompts[:3], prefix="a"))
    assert got[0].output_ids == want[0].output_ids and got[2].output_ids == want[2].output_ids


def test_bad_heads_are_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="--speculative-draft-model-path '/no/such/head'"):
        eagle_engine(tiny, "/no/such/head")
    wide = write_eagle_head(tmp_path / "wide", tiny, hidden=128)
    with pytest.raises(ValueError, match="hidden size 128, the target model 64"):
        eagle_engine(tiny, wide)
    other_vocab = write_eagle_head(tmp_path / "vocab", tiny, vocab=512)
    with pytest.raises(ValueError, match="vocabulary of 512 tokens"):
        eagle_engine(tiny, other_vocab)
    with pytest.raises(ValueError, match="is a LlamaForCausalLM checkpoint"):
        eagle_engine(tiny, tiny)  # a whole model, not a head
    with pytest.raises(ValueError, match="eagle needs --speculative-draft-model-path"):
        Engine(str(tiny), speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="not supported with --compile"):
        Engine(str(tiny), speculative_algorithm="eagle", speculative_draft_model_path=str(tiny),
               compile=True)
