"""EAGLE-3 speculation (`--speculative-algorithm eagle` with a `LlamaForCausalLMEagle3` folder in
SpecForge's layout: `fc` over three target layers' outputs, one `midlayer`, its own norm and
lm_head over a reduced draft vocabulary with `d2t`): the head's drafts and logits equal an
independent implementation built from Hugging Face's Llama modules, greedy output equals
plain decoding with every pool checked, a head built to agree with its target gets its drafts
accepted, and malformed heads stop the start naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from genserve import Engine
from genserve.srt.sampling import SamplingParams
from genserve.srt.tokenizer_manager import make_tokenized_req
from tests.srt.test_speculative import repetitive
from tests.srt.test_speculative_eagle import (
    GREEDY,
    batch,
    eagle_engine,
    run_checked,
    silent_target,
)

AUX = (0, 1, 3)  # the 4-layer target's layers the heads read (the last one before its norm)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A 4-layer tiny Llama (three distinct auxiliary layers need more than the usual 2)."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("eagle3-target")
    tf.LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


def write_eagle3_head(
    folder: Path,
    target: Path,
    *,
    seed: int = 0,
    draft_vocab: int = 96,
    aux: tuple[int, ...] | None = AUX,
    d2t: torch.Tensor | None = None,
    drop: tuple[str, ...] = (),
    fc_width: int | None = None,
    max_positions: int | None = None,
) -> Path:
    """A random EAGLE-3 head for `target` as SpecForge saves one. d2t: the draft -> target
    offsets (default: a random sorted subset of the vocabulary); drop: tensors left out;
    max_positions: its config's max_position_embeddings (default: the target's)."""
    cfg = json.loads((target / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv, inter = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    )
    d = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    def norm() -> torch.Tensor:
        return 1 + rand(h)

    if d2t is None:
        hot = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        d2t = hot - torch.arange(draft_vocab)
    w = {
        "fc.weight": rand(h, fc_width or 3 * h),
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": rand(draft_vocab, h) * 5,
        # SpecForge saves the (frozen) embedding too; a head as wide as its target uses the
        # target's, as SGLang does, so this copy must go unread.
        "embed_tokens.weight": rand(vocab, h),
        "d2t": d2t.to(torch.int64),
    }
    ids = torch.arange(draft_vocab) + d2t
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids[ids < vocab], True)
    folder.mkdir(parents=True, exist_ok=True)
    head_cfg = {
        **cfg,
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
    }
    if max_positions is not None:
        head_cfg["max_position_embeddings"] = max_positions
    if aux is not None:
        head_cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux),
            "use_aux_hidden_state": True,
        }
    (folder / "config.json").write_text(json.dumps(head_cfg))
    save_file(
        {k: v.contiguous() for k, v in w.items() if k not in drop},
        str(folder / "model.safetensors"),
    )
    return folder


@pytest.fixture(scope="module")
def head(target, tmp_path_factory) -> Path:
    # Trained for fewer positions than the target serves (published heads say 2048), as the
    # longer requests below reach past them.
    return write_eagle3_head(tmp_path_factory.mktemp("eagle3-random"), target, max_positions=64)


def reference(
    target: Path, head: Path, prompt: list[int], first: int, steps: int
) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """EAGLE-3 as SpecForge trains it, from Hugging Face's Llama modules: the target's fc'd
    features of the prompt, the head's greedy drafts (target ids) after `prompt` (whose
    next token is `first`) and each draft step's logits over the draft vocabulary."""
    import transformers as tf
    from transformers.models.llama import modeling_llama as hf

    model = tf.LlamaForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    hcfg = json.loads((head / "config.json").read_text())
    aux = sorted(hcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    cfg = tf.LlamaConfig(**hcfg)
    cfg._attn_implementation = "eager"
    w = load_file(str(head / "model.safetensors"))
    h = cfg.hidden_size

    def linear(name: str) -> torch.nn.Linear:
        out, inp = w[name].shape
        lin = torch.nn.Linear(inp, out, bias=False)
        lin.weight.data.copy_(w[name])
        return lin

    def rms(name: str) -> hf.LlamaRMSNorm:
        norm = hf.LlamaRMSNorm(h, cfg.rms_norm_eps)
        norm.weight.data.copy_(w[name])
        return norm

    attn = hf.LlamaAttention(cfg, 0).eval()
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        setattr(attn, proj, linear(f"midlayer.self_attn.{proj}.weight"))
    mlp = hf.LlamaMLP(cfg)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        setattr(mlp, proj, linear(f"midlayer.mlp.{proj}.weight"))
    in_norm, hid_norm = rms("midlayer.input_layernorm.weight"), rms("midlayer.hidden_norm.weight")
    post_norm, final_norm = rms("midlayer.post_attention_layernorm.weight"), rms("norm.weight")
    fc, lm_head = linear("fc.weight"), linear("lm_head.weight")
    rotary = hf.LlamaRotaryEmbedding(cfg)
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: outputs.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
        for i in aux
    ]
    with torch.no_grad():
        model(torch.tensor([prompt]))
        for hook in hooks:
            hook.remove()
        feats = fc(torch.cat([outputs[i][0] for i in aux], dim=-1))  # [len(prompt), h]
        hidden, tokens = feats, prompt[1:] + [first]
        drafts, logits = [], []
        for _ in range(steps):
            n = len(tokens)
            embeds = model.model.embed_tokens(torch.tensor(tokens))
            x = torch.cat([in_norm(embeds), hid_norm(hidden)], dim=-1)[None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            a = attn(x, position_embeddings=rotary(x, pos), attention_mask=mask)[0][0]
            r = a + hidden
            out = mlp(post_norm(r)) + r
            logits.append(lm_head(final_norm(out[-1])))
            best = int(logits[-1].argmax())
            drafts.append(best + int(w["d2t"][best]))
            tokens.append(drafts[-1])
            hidden = torch.cat([hidden, out[-1:]])  # the pre-norm output is fed back
    return feats, drafts, logits


def test_head_follows_the_eagle3_definition(target, head):
    """The target's captured features, the head's logits at each draft step and its drafts
    (draft ids mapped through d2t) equal the Hugging Face reference."""
    prompt = repetitive(7, 23)
    engine = eagle_engine(target, head, speculative_num_steps=4)
    sched = engine.scheduler
    sched.add_request(batch([prompt])[0])
    sched.step()  # the prefill: the target's features of every prompt token are captured
    (req,) = sched.running
    want_feats, want_drafts, want_logits = reference(target, head, prompt, req.output_ids[0], 4)
    start, feats = sched.spec.feats[req.row]
    assert start == 0
    torch.testing.assert_close(feats, want_feats, atol=1e-4, rtol=1e-4)

    runner, seen = sched.spec.head, []
    forward = runner.forward

    def recording(fb, hidden_in):
        logits = forward(fb, hidden_in)
        seen.append(logits[-1].clone())
        return logits

    runner.forward = recording
    drafts = sched.spec.drafts([req], sched.context_length)
    assert drafts[0] == want_drafts
    assert len(seen) == 4 and seen[0].shape == (96,)
    for got, want in zip(seen, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_output_equals_plain_decoding(target, head):
    """A random head: most drafts fail; the output is plain decoding's, every pool checks
    out after each step, and all KV is free again once the prefix cache is flushed."""
    warm = repetitive(50, 40)
    prompts = [repetitive(i, 12 + 11 * i) for i in range(4)]
    prompts.append(warm + [7, 8, 9])  # hits the prefix cache left by the warm-up request
    plain = Engine(str(target), dtype="float32", max_total_tokens=4096)
    plain.generate(input_ids=warm, sampling_params=GREEDY)
    want = run_checked(plain, batch(prompts, logprob_index=2))

    engine = eagle_engine(target, head, speculative_num_steps=3, chunked_prefill_size=32)
    engine.generate(input_ids=warm, sampling_params=GREEDY)
    got = run_checked(engine, batch(prompts, logprob_index=2), stagger=3)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    stats = engine.scheduler.stats
    assert stats["spec_verify_steps"] > 0 and stats["spec_draft_tokens"] > 0
    assert not engine.scheduler.spec.feats  # every finished request's features are gone
    engine.check_integrity()
    assert engine.flush_cache()
    runner = engine.scheduler.runner
    assert runner.allocator.available_size() == runner.max_total_tokens


def agreeing_head(folder: Path, target: Path) -> Path:
    """A head whose first draft is what a silent target (next token = g(current token))
    gives two tokens on: its features are the token embeddings e(t_i), fc keeps the first
    copy, the layer adds nothing, lm_head picks t_i back out of them and d2t maps it to
    g(g(t_i)) = t_{i+2}, the token after the one the draft entry reads."""
    w = load_file(str(target / "model.safetensors"))
    embed, lm_head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    vocab, h = embed.shape
    normed = embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + 1e-5)
    g = (normed @ lm_head.T).argmax(-1)
    write_eagle3_head(folder, target, draft_vocab=vocab, d2t=g[g] - torch.arange(vocab))
    head = load_file(str(folder / "model.safetensors"))
    head["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, 2 * h)], dim=1)
    head["midlayer.self_attn.o_proj.weight"].zero_()
    head["midlayer.mlp.down_proj.weight"].zero_()
    head["norm.weight"] = torch.ones(h)
    head["lm_head.weight"] = normed
    save_file(head, str(folder / "model.safetensors"))
    return folder


def test_an_agreeing_head_gets_its_drafts_accepted(target, tmp_path):
    silent = silent_target(tmp_path / "silent", target)
    agreeing = agreeing_head(tmp_path / "agree", silent)
    prompts = [repetitive(60 + i, 20 + 15 * i) for i in range(3)]
    plain = Engine(str(silent), dtype="float32", max_total_tokens=4096, chunked_prefill_size=16)
    want = run_checked(plain, batch(prompts), stagger=4)
    engine = eagle_engine(silent, agreeing, chunked_prefill_size=16, speculative_num_steps=1)
    got = run_checked(engine, batch(prompts), stagger=4)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    stats = engine.scheduler.stats
    assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_draft_tokens"] > 0
    assert stats["decode_steps"] < 0.6 * stats["generated_tokens"]
    engine.check_integrity()


def test_default_auxiliary_layers():
    """Without eagle_config, a head reads the outputs of layers 1, n/2 - 1 and n - 4, and its
    fc is 3 * hidden wide."""
    import transformers as tf

    from genserve.srt.model_config import ModelConfig
    from genserve.srt.speculative.eagle3_model import resolve_eagle3_layout

    hf = tf.LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=32,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).to_dict()
    hf["architectures"] = ["LlamaForCausalLM"]
    target = ModelConfig.from_dict(hf)
    head = ModelConfig.from_dict({**hf, "num_hidden_layers": 1})
    shapes = {
        "fc.weight": (64, 192),
        "midlayer.self_attn.q_proj.weight": (64, 128),
        "lm_head.weight": (100, 64),
        "d2t": (100,),
    }
    layout = resolve_eagle3_layout("head", {"draft_vocab_size": 100}, head, target, shapes)
    assert layout.aux_layers == (1, 15, 28)
    assert (layout.draft_vocab, layout.own_head, layout.has_d2t) == (100, True, True)
    assert not layout.own_embed


def test_malformed_heads_are_refused(target, tmp_path):
    flag = "--speculative-draft-model-path"
    no_d2t = write_eagle3_head(tmp_path / "no-d2t", target, drop=("d2t",))
    with pytest.raises(
        ValueError, match=f"{flag} .* drafts over 96 of the 256 tokens but has no d2t"
    ):
        eagle_engine(target, no_d2t)
    eagle1_fc = write_eagle3_head(tmp_path / "fc", target, fc_width=128)
    with pytest.raises(
        ValueError,
        match=r"fc.weight is \[64, 128\]; reading 3 target layers "
        r"of width 64 into width 64 needs \[64, 192\]",
    ):
        eagle_engine(target, eagle1_fc)
    past_the_end = write_eagle3_head(tmp_path / "aux", target, aux=(0, 1, 4))
    with pytest.raises(ValueError, match=r"names target layers \[0, 1, 4\]; a 4-layer"):
        eagle_engine(target, past_the_end)
    default_aux = write_eagle3_head(tmp_path / "default", target, aux=None)
    with pytest.raises(ValueError, match=r"the default names target layers \[1, 1, 0\]"):
        eagle_engine(target, default_aux)  # (1, n/2 - 1, n - 4) repeats a layer when n = 4
    no_head = write_eagle3_head(tmp_path / "no-lm-head", target, drop=("lm_head.weight",))
    with pytest.raises(ValueError, match=r"lm_head.weight is None, draft_vocab_size 96"):
        eagle_engine(target, no_head)
    wild = write_eagle3_head(tmp_path / "wild", target, d2t=torch.full((96,), 200))
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target's 256 tokens"):
        eagle_engine(target, wild)


def test_plain_decode_steps_keep_their_features_under_decode_graphs(target, head):
    """With --enable-cuda-graph (its eager capture here), the steps a request decodes plainly
    (its random drafts fail, so it backs off) still leave its features for the head, so it
    can draft again later."""
    params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 100})
    engine = eagle_engine(
        target, head, speculative_num_steps=2, enable_cuda_graph=True, cuda_graph_capture="eager"
    )
    sched = engine.scheduler
    for i in range(2):
        sched.add_request(make_tokenized_req(repetitive(70 + i, 30), params, rid=f"g{i}"))
    while sched.has_work():
        sched.step()
        for req in sched.running:
            start, feats = sched.spec.feats[req.row]
            assert start + feats.shape[0] >= req.kv_len
    stats = sched.stats
    assert stats["decode_steps"] > 2 * stats["spec_verify_steps"] > 0  # plain steps too
    engine.check_integrity()
