"""Synthetic workloads (no download): random prompts, shared-prefix groups, multi-turn chats.

Prompts are random English-ish words; lengths are given in words, which the common BPE
tokenizers map to about one token each (the benchmark reports the server's own token counts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Short, common words: each is a single token in the Llama / SmolLM2 / Qwen vocabularies.
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "has had one not but all new more first after their who they two have her she been other "
    "when there time can its into during most only over city some world would where later up "
    "such used many also may about these three year then under film made both school state "
    "part known out team between while since war being high used work each well called before "
    "national through people them him second game number south north several river public "
    "large early back four around will member life group same area due although center water"
).split()


@dataclass
class BenchRequest:
    """One request of a workload. `system` is the shared part when the backend is chat."""

    prompt: str
    output_len: int
    system: str | None = None
    group: int = 0


@dataclass
class Conversation:
    """A multi-turn chat: the user turns; the assistant's answers come from the server."""

    system: str
    user_turns: list[str] = field(default_factory=list)
    output_len: int = 32


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> list[BenchRequest]:
    """Independent prompts; lengths uniform in [len * range_ratio, len]."""
    if not 0 < range_ratio <= 1:
        raise ValueError(f"--random-range-ratio must be in (0, 1], got {range_ratio}")
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        # A unique number first so no two prompts share a cacheable prefix.
        reqs.append(BenchRequest(f"{rng.randrange(10**9)} " + random_words(rng, n_in - 1),
                                 n_out))
    return reqs


def shared_prefix_dataset(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                          question_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """`num_groups` system prompts, each followed by `prompts_per_group` distinct questions;
    requests are shuffled so groups interleave (what a cache-aware scheduler exploits)."""
    rng = random.Random(seed)
    reqs = []
    for g in range(num_groups):
        system = f"Group {g} instructions: " + random_words(rng, system_prompt_len - 3)
        for _ in range(prompts_per_group):
            question = random_words(rng, question_len)
            reqs.append(BenchRequest(question, output_len, system=system, group=g))
    rng.shuffle(reqs)
    return reqs


def multiturn_dataset(num_conversations: int, turns: int, system_prompt_len: int,
                      turn_len: int, output_len: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [Conversation(system=f"Conversation {c}: " + random_words(rng, system_prompt_len - 2),
                         user_turns=[random_words(rng, turn_len) for _ in range(turns)],
                         output_len=output_len)
            for c in range(num_conversations)]
