"""Unchanged SGLang frontend programs (sglang.lang) against a server given as argv[1]; prints one
JSON object of results. Run in its own process: importing sglang patches transformers."""

import json
import sys

import sglang as sgl


@sgl.function
def complete(s):
    s += "The capital of France is"
    s += sgl.gen("a", max_tokens=8, temperature=0)


@sgl.function
def pick(s):
    s += "Q: What is the capital of France?\nA: The capital of France is"
    s += sgl.select("city", choices=[" London", " Paris", " Tokyo"])


@sgl.function
def branches(s):
    s += "Here are some facts about the city of Paris. " * 10
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Fact {i + 1}:" + sgl.gen("fact", max_tokens=6, temperature=0)
    forks.join()
    s += " ".join(f"Fact {i + 1}:{f['fact']}" for i, f in enumerate(forks)) + " Done."


@sgl.function
def year(s):
    s += "The year the Eiffel Tower was completed:"
    s += sgl.gen("year", regex=r" (1[0-9]{3})", max_tokens=6, temperature=0)


@sgl.function
def capital(s, country):
    s += f"The capital of {country} is"
    s += sgl.gen("a", max_tokens=6, temperature=0)


def main() -> None:
    sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
    out = {"complete": complete.run()["a"], "pick": pick.run()["city"]}
    state = branches.run()
    out["fork_text"] = state.text()
    batch = capital.run_batch([{"country": c} for c in ("France", "Italy")])
    out["batch"] = [st["a"] for st in batch]
    out["year"] = year.run()["year"]
    stream = capital.run(country="France", stream=True)
    out["stream_chunks"] = list(stream.text_iter())
    out["stream_text"] = stream.text()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
