"""Speculative decoding of grammar-constrained requests on the real SmolLM2: the draft is cut
where the grammar rejects it, every verify row gets its grammar mask, and the grammar advances
(with jump-forward) by the kept tokens only. Greedy output equals constrained plain decoding
token for token (n-gram, draft model and EAGLE proposers, alone and in mixed batches, with
and without jump-forward, with logprobs) while drafts are verified and accepted; sampled
output never leaves the grammar; no KV slot leaks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from genserve import Engine
from genserve.srt.sampling import SamplingParams
from genserve.srt.speculative import verify_draft
from genserve.srt.speculative.grammar_verify import constrain_draft, masked_rows
from genserve.srt.speculative.verify import target_probs
from tests.srt.test_speculative import UnmeasuredCost
from tests.srt.test_speculative_eagle import write_eagle_head

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
RECORD = '{"name":"Alice Margaret Smithson","age":42,"city":"Saint-Pierre-des-Corps"}'
ORDER = r"[0-9]{3}-[0-9]{4}-[0-9]{4}-[0-9]{4}"
JSON_PARAMS = {"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(PERSON)}
REGEX_PARAMS = {"max_new_tokens": 30, "temperature": 0, "regex": ORDER}
FREE_PARAMS = {"max_new_tokens": 24, "temperature": 0}


def chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def prompts(engine: Engine) -> dict[str, str]:
    """Prompts that quote what the answer should be, so n-gram drafts exist."""
    return {
        "json": chat(engine, f"Copy this record exactly, as JSON: {RECORD}"),
        "regex": chat(
            engine, "Repeat the order number: 123-4567-8901-2345. Order number: 123-4567-8901-2345."
        ),
        "free": chat(
            engine,
            "Say this twice: the red fox jumps over the lazy dog near the "
            "river bank; the red fox jumps over the lazy dog.",
        ),
    }


def spec_engine(folder, algorithm: str, **kw) -> Engine:
    engine = Engine(
        str(folder), dtype="float32", max_total_tokens=4096, speculative_algorithm=algorithm, **kw
    )
    engine.scheduler.spec.cost = UnmeasuredCost()  # drafts look free: timing never decides
    return engine


def spec_delta(engine: Engine, before: dict) -> dict:
    return {k: v - before[k] for k, v in engine.scheduler.stats.items()}


def check_outputs(outs: list[dict]) -> None:
    """The JSON answer validates, the regex answer matches."""
    jsonschema.validate(json.loads(outs[0]["text"]), PERSON)
    assert re.fullmatch(ORDER, outs[1]["text"]), outs[1]["text"]


_PLAIN_BATCHES: dict[int, list[dict]] = {}


def plain_batch(plain: Engine, texts: dict[str, str]) -> list[dict]:
    """Plain decoding's answers to the json, regex and free prompts in one batch, computed once
    per plain engine (the tests that share one compare with the same answers)."""
    if id(plain) not in _PLAIN_BATCHES:
        _PLAIN_BATCHES[id(plain)] = plain.generate(
            [texts["json"], texts["regex"], texts["free"]],
            [JSON_PARAMS, REGEX_PARAMS, FREE_PARAMS],
        )
    return _PLAIN_BATCHES[id(plain)]


def assert_same_as_plain(
    engine: Engine, plain: Engine, *, draft_accepts: bool = True, alone: bool = True
) -> None:
    """A batch of both constrained requests with a free one speculates and matches plain
    decoding; with `alone`, each constrained request on its own does too, jump-forward taking
    over for as many tokens as in plain decoding."""
    texts = prompts(engine)
    want = plain_batch(plain, texts)
    check_outputs(want)
    for i, (key, params) in enumerate((("json", JSON_PARAMS), ("regex", REGEX_PARAMS))):
        if not alone:
            break
        before = dict(plain.scheduler.stats)
        plain.generate(texts[key], params)
        jumped = spec_delta(plain, before)["jump_forward_tokens"]
        before = dict(engine.scheduler.stats)
        got = engine.generate(texts[key], params)
        assert got["output_ids"] == want[i]["output_ids"], (key, got["text"], want[i]["text"])
        delta = spec_delta(engine, before)
        # Jump-forward took over at the same points, for as many tokens, as in plain decoding.
        assert delta["jump_forward_tokens"] == jumped, (key, delta, jumped)
        if draft_accepts:
            assert delta["spec_verify_steps"] > 0, (key, delta)
            assert delta["spec_accepted_tokens"] > 0, (key, delta)
        else:  # drafts were made and went through the grammar (cut or verified)
            assert delta["spec_draft_tokens"] + delta["spec_grammar_cut_tokens"] > 0, (key, delta)
    before = dict(engine.scheduler.stats)
    got = engine.generate(
        [texts["json"], texts["regex"], texts["free"]], [JSON_PARAMS, REGEX_PARAMS, FREE_PARAMS]
    )
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    check_outputs(got)
    delta = spec_delta(engine, before)
    assert delta["spec_verify_steps"] > 0, delta
    if draft_accepts:
        assert delta["spec_accepted_tokens"] > 0, delta
    engine.check_integrity()


@pytest.fixture(scope="module")
def plain(smollm_folder):
    """Plain decoding of the same weights the speculating engines load (the session's
    `smol_engine` dequantizes the GGUF to float32 directly: not the same numbers)."""
    return Engine(str(smollm_folder), dtype="float32", max_total_tokens=4096)


def test_draft_is_cut_at_the_grammar_and_rows_get_their_masks(plain):
    backend = plain.scheduler.grammar
    tok = plain.tokenizer
    compiled = backend.submit(("regex", r"[0-9]{3}-[0-9]{4}")).result()
    grammar = backend.matcher(compiled)
    prefix = tok.encode("55", add_special_tokens=False)
    for t in prefix:
        assert grammar.accept_token(t)
    good = tok.encode("5-12", add_special_tokens=False)
    letter = tok.encode("x", add_special_tokens=False)
    draft, masks, rejected = constrain_draft(grammar, good + letter + good, backend, False)
    assert draft == good and rejected and masks.shape[0] == len(good) + 1
    # Row j is the mask after the request's tokens plus draft[:j], as a fresh matcher says.
    step = backend.matcher(compiled)
    for t in prefix:
        step.accept_token(t)
    for j in range(len(good) + 1):
        want = backend.allocate_bitmask(1)
        step.fill_bitmask(want, 0)
        assert torch.equal(masks[j], want[0]), j
        if j < len(good):
            step.accept_token(good[j])
    # The matcher is where it was: the draft's first token is still the next one it takes.
    assert grammar.accept_token(good[0]) and not grammar.accept_token(letter[0])
    # A stop token ends the draft (kept: it ends the request); nothing is drafted past it.
    grammar.rollback(1)
    done = tok.encode("5-1234", add_special_tokens=False) + [tok.eos_token_id]
    draft, masks, rejected = constrain_draft(grammar, done + good, backend, False)
    assert draft == done and not rejected and masks.shape[0] == len(done) + 1
    assert not grammar.is_terminated


def test_masked_rejection_sampling_keeps_the_masked_distribution():
    """A 5-token vocabulary whose grammar allows tokens 1, 3, 4 at the first position: the
    emitted token is never 0 or 2 and follows the masked distribution, whatever the draft."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5) * 1.5
    bitmask = torch.tensor([[0b11010], [0b11111]], dtype=torch.int32)
    masked = masked_rows(logits, bitmask)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    p = target_probs(masked, sp)[0]
    assert p[0] == 0 and p[2] == 0
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(5)
    trials = 4000
    for _ in range(trials):
        counts[verify_draft(masked, [4], sp, gen)[0]] += 1
    assert counts[0] == 0 and counts[2] == 0
    sd = (trials * p * (1 - p)).clamp_min(1e-9).sqrt()
    assert ((counts - p * trials).abs() <= 4.5 * sd + 1).all(), (counts, p * trials)


@pytest.fixture(scope="module")
def ngram(smollm_folder):
    return spec_engine(smollm_folder, "ngram", speculative_num_draft_tokens=5)


def test_ngram_greedy_constrained_equals_plain(ngram, plain):
    assert_same_as_plain(ngram, plain)
    assert ngram.scheduler.stats["spec_grammar_cut_tokens"] > 0  # the grammars cut drafts
    assert ngram.scheduler.stats["jump_forward_tokens"] > 0


def test_constrained_requests_end_inside_accepted_drafts(ngram, plain):
    """A length cap and a stop string that fall inside the speculated tokens end the request
    where plain decoding ends it."""
    texts = prompts(ngram)
    per_req = [
        {**JSON_PARAMS, "max_new_tokens": 9},
        {**REGEX_PARAMS, "stop": "8901"},
        {**REGEX_PARAMS, "max_new_tokens": 6},
    ]
    batch = [texts["json"], texts["regex"], texts["regex"]]
    want = plain.generate(batch, per_req)
    before = dict(ngram.scheduler.stats)
    got = ngram.generate(batch, per_req)
    assert spec_delta(ngram, before)["spec_accepted_tokens"] > 0
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["meta_info"]["finish_reason"] for g in got] == [
        w["meta_info"]["finish_reason"] for w in want
    ]
    assert len(got[0]["output_ids"]) == 9 and len(got[2]["output_ids"]) == 6
    assert got[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "8901"}
    assert got[1]["text"] == "123-4567-"
    ngram.check_integrity()


def test_constrained_logprobs_equal_plain(ngram, plain):
    """Logprobs of a constrained request are the raw model's, as plain decoding reports. A
    request asking for logprobs takes no jump-forward, so its drafts are also verified through
    the text the grammar forces (no draft is cut there) and still give plain decoding's
    tokens."""
    text = prompts(ngram)["json"]
    before = dict(ngram.scheduler.stats)
    got = ngram.generate(text, JSON_PARAMS, return_logprob=True, top_logprobs_num=2)
    want = plain.generate(text, JSON_PARAMS, return_logprob=True, top_logprobs_num=2)
    delta = spec_delta(ngram, before)
    assert delta["spec_accepted_tokens"] > 0 and delta["jump_forward_tokens"] == 0, delta
    assert got["output_ids"] == want["output_ids"]
    g, w = got["meta_info"], want["meta_info"]
    assert [i for _, i in g["output_token_logprobs"]] == got["output_ids"]
    assert [v for v, _ in g["output_token_logprobs"]] == pytest.approx(
        [v for v, _ in w["output_token_logprobs"]], abs=1e-4
    )
    for g_top, w_top in zip(g["output_top_logprobs"], w["output_top_logprobs"], strict=True):
        assert [i for _, i in g_top] == [i for _, i in w_top]
    ngram.check_integrity()


def test_sampled_constrained_output_never_leaves_the_grammar(ngram):
    sched = ngram.scheduler
    texts = prompts(ngram)
    reqs = []
    for seed in range(3):
        reqs.append((texts["json"], {**JSON_PARAMS, "temperature": 1.0, "seed": seed}))
        reqs.append(
            (texts["regex"], {**REGEX_PARAMS, "temperature": 1.2, "top_k": 20, "seed": seed})
        )
    before = dict(sched.stats)
    outs = ngram.generate([t for t, _ in reqs], [p for _, p in reqs])
    assert spec_delta(ngram, before)["spec_accepted_tokens"] > 0
    for (_, params), out in zip(reqs, outs, strict=True):
        key = SamplingParams.from_dict(params).grammar_key
        matcher = sched.grammar.matcher(sched.grammar.submit(key).result())
        # Every emitted token (the final stop token included) is one the grammar allows.
        for token in out["output_ids"]:
            assert matcher.accept_token(token), (out["text"], token)
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert matcher.is_terminated
            if "json_schema" in params:
                jsonschema.validate(json.loads(out["text"]), PERSON)
            else:
                assert re.fullmatch(ORDER, out["text"]), out["text"]
    ngram.check_integrity()


def test_draft_model_greedy_constrained_equals_plain(smollm_folder, plain):
    """The target itself drafts: its drafts are right wherever the grammar agrees."""
    engine = spec_engine(
        smollm_folder,
        "draft",
        speculative_draft_model_path=str(smollm_folder),
        speculative_num_steps=4,
    )
    assert_same_as_plain(engine, plain, alone=False)
    draft = engine.scheduler.spec.runner
    assert draft.allocator.available_size() == draft.max_total_tokens  # all draft KV is back


def test_eagle_greedy_constrained_equals_plain(smollm_folder, plain, tmp_path):
    """A random EAGLE head: its drafts are mostly wrong or cut by the grammar, and whatever is
    verified keeps the output."""
    head = write_eagle_head(tmp_path / "eagle", smollm_folder)
    engine = spec_engine(
        smollm_folder, "eagle", speculative_draft_model_path=str(head), speculative_num_steps=3
    )
    before = dict(engine.scheduler.stats)
    assert_same_as_plain(engine, plain, draft_accepts=False, alone=False)
    assert spec_delta(engine, before)["spec_verify_steps"] > 0
    assert not engine.scheduler.spec.feats
