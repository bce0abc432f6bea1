"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding, side by side.

    python benchmarks/bench_speculative.py                    # the default model, as served
    python benchmarks/bench_speculative.py --draft-tokens 6 --max-tokens 96
    python benchmarks/bench_speculative.py --algorithms ngram,draft --model BIG --draft-model SMALL
    python benchmarks/bench_speculative.py --algorithms ngram,draft --smoke   # a seconds-long check
    python benchmarks/bench_speculative.py --algorithms ngram,ngram-tree --bfs-breadth 4

Engines on one model (default: the embedded SmolLM2-135M-Instruct), set up as `genserve serve`
sets it up (`--quantization auto`, compile by default): one plain, and one per algorithm asked
for: `--speculative-algorithm ngram`, `ngram-tree` (ngram with draft trees of up to
`--bfs-breadth` candidates, `--speculative-ngram-max-bfs-breadth`), and `draft` with
`--draft-model` (default: the target itself, which checks the machinery, not the speed: a
draft as large as the target never pays).
Requests run one at a time (a single stream), alternating between the engines, greedy:
- grounded: 32 chat requests whose answer copies from the prompt (edit this code, extract these
  fields, quote the sentence);
- free: 16 free-form chat requests (stories, explanations);
- structured (not run unless `--sets` names it): 16 grammar-constrained requests, the
  extraction prompts under a JSON schema and the quoting prompts under a one-sentence regex.
Reports output tokens/s (prefill included, the same on every side), each algorithm's speed-up
and whether every output is identical to plain decoding. Prints a JSON summary. `--smoke`: two
requests per workload, 16 tokens, float32, no quantization or compile.
"""

from __future__ import annotations

import argparse
import json
import time

CODE = [
    ("total", "def average(values):\n    total = 0\n    for v in values:\n        total += v\n"
              "    return total / len(values)\n"),
    ("items", "def count_words(text):\n    items = {}\n    for word in text.split():\n"
              "        items[word] = items.get(word, 0) + 1\n    return items\n"),
    ("result", "def clamp(x, low, high):\n    result = x\n    if result < low:\n"
               "        result = low\n    if result > high:\n        result = high\n"
               "    return result\n"),
    ("buf", "def read_lines(path):\n    buf = []\n    with open(path) as f:\n"
            "        for line in f:\n            buf.append(line.rstrip())\n    return buf\n"),
    ("acc", "def flatten(rows):\n    acc = []\n    for row in rows:\n        for cell in row:\n"
            "            acc.append(cell)\n    return acc\n"),
    ("seen", "def unique(xs):\n    seen = set()\n    out = []\n    for x in xs:\n"
             "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n"
             "    return out\n"),
    ("n", "def factorial(n):\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)\n"),
    ("text", "def shout(text):\n    text = text.strip()\n    text = text.upper()\n"
             "    return text + '!'\n"),
]
PEOPLE = [
    ("Alice Martin", "alice.martin@example.com", "+1 415 555 0101", "Lisbon"),
    ("Bruno Costa", "bruno.costa@example.org", "+351 21 555 0199", "Porto"),
    ("Chen Wei", "chen.wei@example.net", "+86 10 5555 0123", "Beijing"),
    ("Dana Levi", "dana.levi@example.com", "+972 3 555 0144", "Tel Aviv"),
    ("Emeka Obi", "emeka.obi@example.org", "+234 1 555 0177", "Lagos"),
    ("Freya Lund", "freya.lund@example.net", "+46 8 555 0166", "Stockholm"),
    ("Goro Sato", "goro.sato@example.com", "+81 3 5555 0155", "Osaka"),
    ("Hana Novak", "hana.novak@example.org", "+420 2 555 0133", "Prague"),
]
PASSAGES = [
    "The river rises in the northern hills. It flows south through three towns. "
    "The old stone bridge at Millford was built in 1642 and still carries traffic today. "
    "Fishermen gather below it every spring.",
    "Our library opens at nine in the morning. Children's story time is held every Saturday "
    "at eleven o'clock in the reading room. The café closes an hour before the library.",
    "The recipe needs two cups of flour. Bake the loaf at 220 degrees for thirty-five "
    "minutes, until the crust is deep brown. Let it cool before slicing.",
    "The museum's east wing holds the ship models. Entry to the observatory on the roof is "
    "free for visitors under twelve years old. Guided tours leave from the main hall.",
    "The trail is eleven kilometres long. Hikers should carry at least two litres of water "
    "because there are no springs after the second bridge. The summit hut is open in summer.",
    "The meeting moved to Thursday. The budget review will now take place in room 4B at half "
    "past two, after the design presentation. Please bring the printed reports.",
    "Our cat sleeps most of the day. At night she walks along the garden wall and watches "
    "the foxes that come to drink from the pond. She is back indoors by dawn.",
    "The station was rebuilt last year. Trains to the airport leave every fifteen minutes "
    "from platform six between five in the morning and midnight. Tickets are sold on board.",
]
QUESTIONS = [
    "when the bridge was built", "when story time is held", "how long to bake the loaf",
    "who gets free entry to the observatory", "why hikers should carry water",
    "where the budget review takes place", "what the cat watches at night",
    "how often the airport trains leave",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle works to a ten-year-old.",
    "Describe a walk through a busy market in a coastal town in the morning.",
    "List ten ideas for a weekend trip and say why each one is fun.",
    "Write a poem about the first snow of winter.",
    "What are the benefits of learning a second language?",
    "Describe your ideal breakfast and how to make it.",
    "Tell me about the history of the printing press.",
]


def grounded_prompts() -> list[str]:
    out = []
    for name, code in CODE:  # 16: rename and add a docstring
        out.append(f"Rename the variable `{name}` to `value` in this Python function and "
                   f"return the whole function:\n```python\n{code}```")
        out.append("Add type hints to this Python function and return the whole function:\n"
                   f"```python\n{code}```")
    for name, email, phone, city in PEOPLE:  # 8: extraction
        out.append("Extract the name, email, phone and city from this message as JSON.\n"
                   f"Message: Hello, this is {name}. You can reach me at {email} or call "
                   f"{phone}. I live in {city} and would like to book a table for two.")
    for passage, question in zip(PASSAGES, QUESTIONS, strict=True):  # 8: quoting
        out.append(f"Quote the sentence of this text that says {question}.\nText: {passage}")
    return out


CONTACT_SCHEMA = json.dumps({
    "type": "object",
    "properties": {k: {"type": "string", "maxLength": 60}
                   for k in ("name", "email", "phone", "city")},
    "required": ["name", "email", "phone", "city"],
    "additionalProperties": False,
})
SENTENCE_REGEX = r"[A-Z][^.\n]{0,200}\."


def structured_requests() -> list[tuple[str, dict]]:
    """(prompt, grammar parameter) of the structured set: extraction as JSON, quoting."""
    grounded = grounded_prompts()
    extract = [(t, {"json_schema": CONTACT_SCHEMA}) for t in grounded[16:24]]
    quote = [(t, {"regex": SENTENCE_REGEX}) for t in grounded[24:32]]
    return extract + quote


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run(engines: dict, prompts: list[list[int]], params: dict,
        extra: list[dict] | None = None) -> dict:
    """Rotate the engines' order request by request; totals per engine. extra: each request's
    own sampling parameters on top of `params` (a grammar)."""
    res = {name: {"tokens": 0, "seconds": 0.0, "outputs": []} for name in engines}
    for i, ids in enumerate(prompts):
        order = list(engines.items())
        order = order[i % len(order):] + order[: i % len(order)]  # nobody always runs first
        req_params = {**params, **(extra[i] if extra else {})}
        for name, engine in order:
            start = time.perf_counter()
            out = engine.generate(input_ids=ids, sampling_params=req_params)
            res[name]["seconds"] += time.perf_counter() - start
            res[name]["tokens"] += len(out["output_ids"])
            res[name]["outputs"].append(out["output_ids"])
    return res


def speculative_kwargs(args: argparse.Namespace, algorithm: str) -> dict:
    kw: dict = {"speculative_algorithm": algorithm}
    if algorithm == "ngram-tree":
        kw["speculative_algorithm"] = algorithm = "ngram"
        kw["speculative_ngram_max_bfs_breadth"] = args.bfs_breadth
    if args.draft_tokens:
        kw["speculative_num_draft_tokens"] = args.draft_tokens
    if algorithm == "ngram" and args.min_window:
        kw["speculative_ngram_min_match_window_size"] = args.min_window
        kw["speculative_ngram_max_match_window_size"] = max(6, args.min_window)
    if algorithm == "draft":
        kw["speculative_draft_model_path"] = args.draft_model or args.model or (
            "SmolLM2-135M-Instruct")
    return kw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algorithms", default="ngram",
                    help="comma-separated speculative algorithms to compare: ngram, ngram-tree, "
                         "draft")
    ap.add_argument("--bfs-breadth", type=int, default=4,
                    help="ngram-tree: --speculative-ngram-max-bfs-breadth")
    ap.add_argument("--model", default=None, help="target model (default: the embedded one)")
    ap.add_argument("--draft-model", default=None,
                    help="draft: --speculative-draft-model-path (default: the target itself)")
    ap.add_argument("--draft-tokens", type=int, default=None)
    ap.add_argument("--min-window", type=int, default=None,
                    help="--speculative-ngram-min-match-window-size (default: the runtime's)")
    ap.add_argument("--sets", default="grounded,free",
                    help="which workloads to run: grounded, free, structured")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="auto",
                    help="float32 makes plain and verify forwards round alike, so greedy outputs "
                         "must be identical (bf16 extend and decode kernels round differently)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--limit", type=int, default=None, help="run only the first N of each set")
    ap.add_argument("--smoke", action="store_true",
                    help="2 requests per set, 16 tokens, float32, no quantization or compile")
    args = ap.parse_args()
    if args.smoke:
        args.limit, args.max_tokens, args.dtype = 2, 16, "float32"
        args.quantization, args.compile = "none", False

    from genserve import Engine

    common = dict(quantization=args.quantization, compile=args.compile, dtype=args.dtype)
    algorithms = [a for a in args.algorithms.split(",") if a]
    engines = {"plain": Engine(args.model, **common)}
    for algorithm in algorithms:
        engines[algorithm] = Engine(args.model, **common, **speculative_kwargs(args, algorithm))
    tok = engines["plain"].tokenizer
    params = {"max_new_tokens": args.max_tokens, "temperature": 0}
    structured = structured_requests()
    sets = {"grounded": (grounded_prompts(), None), "free": (FREE * 2, None),
            "structured": ([t for t, _ in structured], [g for _, g in structured])}
    sets = {k: v for k, v in sets.items() if k in args.sets.split(",")}
    summary: dict = {"quantization": engines["plain"].server_info().get("quantization"),
                     "compile": engines["plain"].server_info().get("compile")}
    for label, (texts, extra) in sets.items():
        ids = [chat_ids(tok, t) for t in texts[: args.limit]]
        extra = extra[: args.limit] if extra else None
        # One warm-up request per engine (first-call allocations, compile).
        run(engines, ids[:1], {"max_new_tokens": 8, "temperature": 0})
        before = {a: dict(engines[a].server_info()["stats"]) for a in algorithms}
        res = run(engines, ids, params, extra)
        rate = {k: v["tokens"] / v["seconds"] for k, v in res.items()}
        summary[label] = {"requests": len(ids), "plain_tok_s": round(rate["plain"], 1)}
        for a in algorithms:
            after = engines[a].server_info()["stats"]
            drafted = after["spec_draft_tokens"] - before[a]["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before[a]["spec_accepted_tokens"]
            steps = after["decode_steps"] - before[a]["decode_steps"]
            cut = after["spec_grammar_cut_tokens"] - before[a]["spec_grammar_cut_tokens"]
            summary[label][a] = {
                "tok_s": round(rate[a], 1),
                "speedup": round(rate[a] / rate["plain"], 3),
                "identical_outputs": res["plain"]["outputs"] == res[a]["outputs"],
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "tokens_per_decode_step": round(res[a]["tokens"] / max(1, steps), 2),
                "tree_verifies": after["spec_tree_verifies"] - before[a]["spec_tree_verifies"],
                "grammar_cut_tokens": cut,
            }
        print(label, json.dumps(summary[label]), flush=True)
    print(json.dumps(summary, indent=2))
    for engine in engines.values():
        engine.shutdown()


if __name__ == "__main__":
    main()
