"""Embeddings throughput: genserve's offline Engine (the encoder runtime `genserve serve` runs in
its scheduler process, without the HTTP and pipe hops) against sentence-transformers'
`SentenceTransformer.encode` on the same folder, in the same process, in interleaved rounds.

The model is a small random-weight BERT encoder (MiniLM-L6-sized: 6 layers, hidden 384, mean
pooling + Normalize) saved as a sentence-transformers folder; the batch is 256 short texts. Both
run float32 on the CPU with the same torch threads. Prints texts/s of each and the ratio.

    python benchmarks/bench_embeddings.py [--rounds 3] [--texts 256]
    python benchmarks/bench_embeddings.py --smoke    # a 1-layer, 32-wide encoder, 8 texts
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.embedding_checkpoints import WORDS, write_bert_embedder  # noqa: E402


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--smoke", action="store_true",
                        help="a 1-layer, 32-wide encoder, 8 texts, 1 round: checks the script")
    args = parser.parse_args()
    hidden, layers = 384, 6
    if args.smoke:
        hidden, layers, args.texts, args.rounds = 32, 1, 8, 1

    import torch
    from sentence_transformers import SentenceTransformer

    from genserve.srt.engine import Engine

    batch = texts(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_bert_embedder(Path(tmp) / "minilm-sized", hidden=hidden, layers=layers)
        reference = SentenceTransformer(str(folder), device="cpu")
        engine = Engine(str(folder), dtype="float32", device="cpu")
        ours = torch.tensor(engine.encode(batch[:8]))
        ref = reference.encode(batch[:8], convert_to_tensor=True)
        cos = torch.nn.functional.cosine_similarity(ours, ref).min().item()
        times: dict[str, list[float]] = {"genserve": [], "sentence-transformers": []}
        for _ in range(args.rounds):  # interleaved: both see the same machine state
            start = time.perf_counter()
            engine.encode(batch)
            times["genserve"].append(time.perf_counter() - start)
            start = time.perf_counter()
            reference.encode(batch)
            times["sentence-transformers"].append(time.perf_counter() - start)
        engine.shutdown()
    rates = {k: args.texts / statistics.median(v) for k, v in times.items()}
    print(f"{args.texts} texts, {args.rounds} rounds, torch threads {torch.get_num_threads()}, "
          f"min cosine vs sentence-transformers {cos:.6f}")
    for name, rate in rates.items():
        print(f"  {name:22s} {rate:8.1f} texts/s (median of {args.rounds})")
    print(f"  ratio genserve / sentence-transformers: "
          f"{rates['genserve'] / rates['sentence-transformers']:.2f}x")


if __name__ == "__main__":
    main()
