"""JSON extraction with a schema-constrained gen (needs a server or engine with constrained
decoding), against the embedded default model.

    python examples/lang_json_extraction.py [--url http://127.0.0.1:30000]
"""

import argparse
import json

from genserve.lang import EngineBackend, RuntimeEndpoint, assistant, function, gen, user

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@function
def extract(s, text):
    s += user(f"Extract the person's name and age as JSON: {text}")
    s += assistant(gen("person", max_tokens=48, json_schema=PERSON, temperature=0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    args = ap.parse_args()
    if args.url:
        backend = RuntimeEndpoint(args.url)
    else:
        from genserve import Engine

        backend = EngineBackend(Engine())
    state = extract.run(text="Alice is 31 and lives in Lyon.", backend=backend)
    print(json.loads(state["person"]))


if __name__ == "__main__":
    main()
