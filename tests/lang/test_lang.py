"""genserve.lang programs on both backends (a real server over HTTP and the in-process Engine),
with the embedded SmolLM2-135M-Instruct: roles rendered by its own chat template, gen, select,
fork sharing the prefix through the radix cache, run_batch, streaming, and clear errors."""

from __future__ import annotations

import pytest

from genserve.lang import (
    ProgramError,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    image,
    select,
    system,
    user,
)

pytestmark = pytest.mark.slow


@function
def capital(s, country):
    s += system("Answer in one short sentence.")
    s += user(f"What is the capital of {country}?")
    s += assistant(gen("answer", max_tokens=16))


def _template_text(backend, messages, gen_prompt=False):
    from genserve.srt.model_loader import resolve_model_folder
    from genserve.srt.tokenizer_manager import load_tokenizer

    tok = load_tokenizer(resolve_model_folder(None)[0])
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


def test_roles_render_with_the_models_chat_template(backend):
    state = capital.run(country="France", backend=backend, temperature=0)
    assert "Paris" in state["answer"]
    assert state.messages() == [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": state["answer"]},
    ]
    assert state.text() == _template_text(backend, state.messages())


def test_default_system_prompt_when_the_program_has_none(backend):
    @function
    def ask(s):
        s += user("Hi")
        s += assistant("Hello!")

    state = ask.run(backend=backend)
    assert state.text() == _template_text(backend, state.messages())
    assert "SmolLM" in state.text()  # the template's own default system turn


def test_select_picks_the_likeliest_choice(backend):
    @function
    def pick(s):
        s += user("What is the capital of France?")
        s += assistant("The capital of France is " + select("city", ["London", "Paris", "Tokyo"]))

    state = pick.run(backend=backend)
    assert state["city"] == "Paris"
    meta = state.get_meta_info("city")
    assert len(meta["scores"]) == 3 and max(meta["scores"]) == meta["scores"][1]
    assert state.text().endswith("The capital of France is Paris<|im_end|>\n")


def test_gen_with_choices_is_a_select(backend):
    @function
    def pick(s, via_gen):
        s += user("What is the capital of France?")
        choices = ["Tokyo", "Paris", "London"]
        chosen = gen("city", choices=choices) if via_gen else select("city", choices)
        s += assistant("The capital of France is " + chosen)

    by_gen = pick.run(via_gen=True, backend=backend)
    by_select = pick.run(via_gen=False, backend=backend)
    scores = by_gen.get_meta_info("city")["scores"]
    # The second run hits the radix cache, so its prefill runs in another shape:
    # the logprobs agree to float rounding, not bit for bit.
    assert scores == pytest.approx(by_select.get_meta_info("city")["scores"], abs=1e-3)
    assert by_gen["city"] == by_select["city"] == "Paris"
    assert max(scores) == scores[1] and len(set(scores)) == 3


def test_fork_branches_share_the_prefix(backend):
    context = "Here are some facts about the city of Paris. " * 12
    kept = []

    @function
    def branches(s):
        s += user(context + "Name one thing to see there.")
        s += assistant("")
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Idea {i + 1}: " + gen("idea", max_tokens=8, temperature=0)
        forks.join()
        kept.extend(forks)
        s += "Ideas: " + " | ".join(f["idea"] for f in forks)

    state = branches.run(backend=backend)
    assert len(kept) == 3
    for i, f in enumerate(kept):
        assert f"Idea {i + 1}: " + f["idea"] in f.text()
        assert f["idea"] in state.text()
        meta = f.get_meta_info("idea")
        # ~130 tokens of shared context: each branch prefilled at most its own suffix.
        assert meta["prompt_tokens"] > 100
        assert meta["cached_tokens"] >= meta["prompt_tokens"] - 8, meta


def test_run_batch_keeps_order_with_a_progress_bar(backend):
    states = capital.run_batch([{"country": c} for c in ("France", "Germany", "Italy")],
                               backend=backend, progress_bar=True, temperature=0)
    assert [s.messages()[1]["content"] for s in states] == [
        f"What is the capital of {c}?" for c in ("France", "Germany", "Italy")]
    assert "Paris" in states[0]["answer"]


def test_regex_and_json_schema_gens(backend):
    import json
    import re

    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}

    @function
    def structured(s):
        s += user("Alice is 31. When was she born, and who is she?")
        s += assistant("Born in " + gen("year", regex=r"(19|20)[0-9]{2}", max_tokens=6)
                       + ". As JSON: " + gen("person", json_schema=person, max_tokens=40))

    state = structured.run(backend=backend, temperature=0)
    assert re.fullmatch(r"(19|20)[0-9]{2}", state["year"])
    parsed = json.loads(state["person"])
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)

    @function
    def bad_regex(s):
        s += "x" + gen("broken", regex="(unclosed", max_tokens=4)

    with pytest.raises(ProgramError, match=r"gen\('broken'\).*(regex|parenthes)"):
        bad_regex.run(backend=backend)


def test_streaming_text_iter(backend):
    state = capital.run(country="France", backend=backend, temperature=0, stream=True)
    chunks = list(state.text_iter())
    assert len(chunks) > 3
    assert "".join(chunks) == state.text()
    assert "Paris" in state["answer"]


def test_errors_name_the_call(backend):
    @function
    def bad(s):
        s += "Hello"
        s += gen("broken", max_tokens=4, temperature=-1)
        s += gen("never", max_tokens=4)

    with pytest.raises(ProgramError, match=r"gen\('broken'\).*temperature"):
        bad.run(backend=backend)

    with pytest.raises(ValueError, match="choices must be a non-empty list"):
        select("x", [])

    @function
    def look(s):
        s += user(image(b"\x89PNG not really"))

    with pytest.raises(ProgramError, match=r"image\(\).*takes no images"):
        look.run(backend=backend)


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(ProgramError, match="cannot reach the server at http://127.0.0.1:9"):
        RuntimeEndpoint("http://127.0.0.1:9")


def test_generate_scoring_fields_over_http(server_url):
    """What frontends send to /generate: prompt scoring in SGLang's shape, and clear 400s."""
    import httpx

    body = {"text": ["The capital of France is Paris", "The capital of France is Rome"],
            "sampling_params": {"max_new_tokens": 0, "stop_regex": []},
            "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 4,
            "token_ids_logprob": [12]}
    r = httpx.post(server_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    paris, rome = (o["meta_info"] for o in r.json())
    for meta in (paris, rome):
        entries = meta["input_token_logprobs"]
        assert entries[0][0] is None and len(entries) == meta["prompt_tokens"] - 4
        assert all(len(e) == 3 and isinstance(e[2], str) for e in entries)
        assert meta["output_token_logprobs"] == []
        assert meta["input_token_ids_logprobs"][0] is None
        assert [e[1] for e in meta["input_token_ids_logprobs"][1]] == [12]
    assert paris["input_token_logprobs"][-1][2].strip() == "Paris"
    assert paris["input_token_logprobs"][-1][0] > rome["input_token_logprobs"][-1][0]
    for bad, field in (({"logprob_start_len": 2}, "return_logprob"),
                       ({"return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
                       ({"sampling_params": {"stop_regex": "x+"}}, "stop_regex")):
        r = httpx.post(server_url + "/generate", json={"text": "Hi", **bad}, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
