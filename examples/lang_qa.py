"""genserve.lang basics against the embedded default model, in-process (no server needed).

    python examples/lang_qa.py                 # in-process Engine
    python examples/lang_qa.py --url http://127.0.0.1:30000   # a running `genserve serve`
"""

import argparse

from genserve.lang import EngineBackend, RuntimeEndpoint, assistant, function, gen, select, user


@function
def qa(s, question):
    s += user(question)
    s += assistant(gen("answer", max_tokens=32))


@function
def capital_quiz(s):
    s += user("What is the capital of France?")
    s += assistant("The capital of France is " + select("city", ["London", "Paris", "Tokyo"]))


@function
def self_consistency(s, question):
    s += user(question)
    s += assistant("")
    forks = s.fork(3)
    for f in forks:
        f += gen("answer", max_tokens=16, temperature=0.8)
    forks.join()
    answers = [f["answer"].strip() for f in forks]
    s += max(set(answers), key=answers.count)
    return answers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a genserve server; default: an in-process Engine")
    args = ap.parse_args()
    if args.url:
        backend = RuntimeEndpoint(args.url)
    else:
        from genserve import Engine

        backend = EngineBackend(Engine())
    print(qa.run(question="What is the capital of France?", backend=backend,
                 temperature=0)["answer"])
    print("select picked:", capital_quiz.run(backend=backend)["city"])
    state = self_consistency.run(question="What is 2 + 3? Answer with a number.",
                                 backend=backend)
    print("majority:", state.text().rsplit("\n", 1)[-1])
    for country in qa.run_batch([{"question": f"What is the capital of {c}?"}
                                 for c in ("Italy", "Spain", "Germany")],
                                backend=backend, temperature=0, progress_bar=True):
        print(country["answer"])
    stream = qa.run(question="Tell me a short fact about cats.", backend=backend, stream=True)
    for chunk in stream.text_iter():
        print(chunk, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
