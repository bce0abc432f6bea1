"""Grammar-constrained decoding (xgrammar) on the real SmolLM2: outputs match their schema /
regex / EBNF, alone and in mixed batches, with n > 1, stop strings, max_new_tokens, abort and
retraction; bad grammars are clear errors and never stop the scheduler."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from genserve import Engine
from genserve.srt.messages import TokenizedGenerateReq
from genserve.srt.sampling import SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "London", "Berlin"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def test_json_schema_regex_and_ebnf_outputs_match(smol_engine):
    prompt = chat(smol_engine, "Describe a person as JSON.")
    out = smol_engine.generate(
        prompt, {"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(PERSON)}
    )
    jsonschema.validate(json.loads(out["text"]), PERSON)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"

    phone = r"[0-9]{3}-[0-9]{4}"
    out = smol_engine.generate(
        chat(smol_engine, "Give me a phone number."),
        {"max_new_tokens": 20, "temperature": 0, "regex": phone},
    )
    assert re.fullmatch(phone, out["text"]), out["text"]

    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    out = smol_engine.generate(
        chat(smol_engine, "Is Paris in France?"),
        {"max_new_tokens": 20, "temperature": 0, "ebnf": grammar},
    )
    assert out["text"] in ("The answer is yes.", "The answer is no.")
    smol_engine.check_integrity()


def test_mixed_batch_n_stop_and_length(smol_engine):
    prompt = chat(smol_engine, "What is the capital of France?")
    free = {"max_new_tokens": 12, "temperature": 0}
    solo = smol_engine.generate(prompt, free)
    constrained = {
        "max_new_tokens": 60,
        "temperature": 0.9,
        "seed": 3,
        "n": 3,
        "json_schema": json.dumps(PERSON),
    }
    outs = smol_engine.generate([prompt, prompt], [free, constrained])
    # The unconstrained row is untouched by its constrained neighbours.
    assert outs[0]["text"] == solo["text"]
    for out in outs[1:]:
        jsonschema.validate(json.loads(out["text"]), PERSON)
    # max_new_tokens cuts a constrained output: finish_reason says length.
    cut = smol_engine.generate(
        prompt, {"max_new_tokens": 4, "temperature": 0, "json_schema": json.dumps(PERSON)}
    )
    assert cut["meta_info"]["finish_reason"]["type"] == "length"
    assert cut["text"].startswith('{"') and len(cut["output_ids"]) == 4
    # A stop string ends a constrained request like any other.
    stopped = smol_engine.generate(
        prompt,
        {
            "max_new_tokens": 60,
            "temperature": 0,
            "json_schema": json.dumps(PERSON),
            "stop": '"age"',
        },
    )
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": '"age"'}
    assert stopped["text"].startswith('{"name":') and '"age"' not in stopped["text"]
    smol_engine.check_integrity()


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"regex": "[a-"}, "Unclosed"),
        (
            {"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})},
            "json_schema",
        ),
        ({"ebnf": "root ::= missing_rule"}, "missing_rule"),
    ],
)
def test_bad_grammar_is_a_clear_error_and_others_keep_running(smol_engine, params, fragment):
    with pytest.raises(ValueError) as err:
        smol_engine.generate("Hi", {"max_new_tokens": 4, **params})
    assert fragment in str(err.value)
    assert "/project/" not in str(err.value)  # no C++ source paths
    assert smol_engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"]
    smol_engine.check_integrity()


def test_params_validation():
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(json_schema="{bad")
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    assert SamplingParams(regex="a+").grammar_key == ("regex", "a+")
    assert SamplingParams().grammar_key is None


def _req(rid: str, ids: list[int], **params) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=SamplingParams(**params))


def test_compile_cache_abort_and_retraction(smollm_folder):
    engine = Engine(
        str(smollm_folder), dtype="float32", max_total_tokens=160, max_running_requests=4
    )
    sched = engine.scheduler
    schema = json.dumps(
        {
            "type": "object",
            "properties": {
                "words": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                    "minItems": 16,
                    "maxItems": 16,
                }
            },
            "required": ["words"],
            "additionalProperties": False,
        }
    )
    ids = engine.tokenizer.encode(chat(engine, "List some words as JSON."))
    solo = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 100, "temperature": 0, "json_schema": schema},
    )
    for k in range(4):
        sched.add_request(
            _req(f"r{k}", ids + [28] * k, max_new_tokens=100, temperature=0, json_schema=schema)
        )
    sched.add_request(_req("gone", ids, max_new_tokens=100, json_schema=schema))
    sched.abort("gone")  # aborted while its grammar is looked up
    texts: dict[str, str] = {}
    reasons: dict[str, str] = {}
    steps = 0
    while sched.has_work():
        for out in sched.step():
            texts[out.rid] = texts.get(out.rid, "") + out.text_delta
            if out.finished:
                reasons[out.rid] = out.finish_reason["type"]
        steps += 1
        if steps == 5:
            sched.abort("r3")  # aborted mid-decode
        assert steps < 3000
    assert reasons["gone"] == "abort" and reasons["r3"] == "abort"
    assert sched.stats["retractions"] > 0
    for k in range(3):
        assert reasons[f"r{k}"] == "stop"
        assert len(json.loads(texts[f"r{k}"])["words"]) == 16
    assert texts["r0"] == solo["text"]
    grammar = sched.grammar.info()
    assert grammar["compiles"] == 1 and grammar["cache_hits"] == 5
    sched.check_integrity()


EXTRACT = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 16},
        "order_status": {"type": "string", "enum": ["pending_payment", "shipped_to_customer"]},
        "shipping_address": {
            "type": "object",
            "properties": {
                "street_and_number": {"type": "string", "maxLength": 16},
                "country_code": {"type": "string", "enum": ["FR", "DE"]},
            },
            "required": ["street_and_number", "country_code"],
            "additionalProperties": False,
        },
    },
    "required": ["customer_full_name", "order_status", "shipping_address"],
    "additionalProperties": False,
}


def _skeleton(text: str) -> str:
    """The JSON text with every value replaced by its type (keys and their order kept)."""

    def shape(v):
        if isinstance(v, dict):
            return {k: shape(x) for k, x in v.items()}
        if isinstance(v, list):
            return [shape(x) for x in v]
        return type(v).__name__

    return json.dumps(shape(json.loads(text)))


def test_jump_forward_valid_streamed_and_fewer_steps(smol_engine):
    """The same three requests (one greedy, two sampled) with jump-forward on and then off, on
    the session's engine (its scheduler reads its arguments at each step): each output is valid and
    streamed whole, and jump-forward takes fewer forwards. Counts are this test's own deltas."""
    sched = smol_engine.scheduler
    ids = smol_engine.tokenizer.encode(chat(smol_engine, "Extract the order: Anna ships to Paris."))

    def run(jump: bool) -> tuple[list[str], list[list[int]], dict]:
        before = dict(sched.stats)
        saved = sched.args
        sched.args = dataclasses.replace(saved, jump_forward=jump)
        try:
            for k in range(3):
                sched.add_request(
                    TokenizedGenerateReq(
                        rid=f"jf{int(jump)}-{k}",
                        input_ids=ids,
                        stream=True,
                        sampling_params=SamplingParams(
                            max_new_tokens=120,
                            temperature=0.0 if k == 0 else 0.8,
                            seed=k,
                            json_schema=json.dumps(EXTRACT),
                        ),
                    )
                )
            texts, ids_out = ["", "", ""], [[], [], []]
            while sched.has_work():
                for out in sched.step():
                    k = int(out.rid.rsplit("-", 1)[1])
                    texts[k] += out.text_delta
                    ids_out[k] += out.new_ids
        finally:
            sched.args = saved
        for k in range(3):
            jsonschema.validate(json.loads(texts[k]), EXTRACT)
            assert smol_engine.tokenizer.decode(ids_out[k], skip_special_tokens=True) == texts[k]
        sched.check_integrity()
        return texts, ids_out, {key: sched.stats[key] - before.get(key, 0) for key in sched.stats}

    on_texts, on_ids, on = run(True)
    off_texts, _, off = run(False)
    # The skeleton the grammar forces (keys, their order, punctuation) is the same with and
    # without jump-forward. The values the model chooses may differ: jump-forward feeds the
    # forced text in the tokenizer's own tokens, not in the pieces a step-by-step decode picks,
    # so the model reads a different (more natural) context.
    assert _skeleton(on_texts[0]) == _skeleton(off_texts[0])
    assert off["jump_forward_tokens"] == 0 and on["jump_forward_tokens"] > 20
    forwards_on = on["decode_steps"] + on["prefill_batches"]
    assert forwards_on < off["decode_steps"] + off["prefill_batches"]
    # The boundary is retokenized: the greedy output is exactly the tokenizer's own
    # tokenization of its text (then the end-of-turn token).
    assert on_ids[0][:-1] == smol_engine.tokenizer.encode(on_texts[0], add_special_tokens=False)
