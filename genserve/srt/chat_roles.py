"""A chat template cut into per-role text markers, for frontends that build prompts piece by piece.

`genserve.lang` appends a program's text as it runs (`s += user("hi")`, then `gen`), so it needs
each role's opening and closing text rather than a whole rendered conversation. They are read off
the tokenizer's own Jinja template by rendering a few conversations with sentinel contents and
cutting at the sentinels, so any template that renders system / user / assistant turns in order
gives the same text as `apply_chat_template` would.

No torch here: the gateway reports these markers in `/get_model_info`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_S, _U1, _A1, _U2 = "\x00SYS\x00", "\x00USR1\x00", "\x00AST1\x00", "\x00USR2\x00"


def chat_role_markers(tokenizer: Any) -> dict[str, Any] | None:
    """{"system": [prefix, suffix], "user": [...], "assistant": [...], "default_head": str}, or
    None when the tokenizer has no chat template or the template cannot be cut this way.

    `default_head` is the text a conversation without a system turn starts with (some templates
    insert a default system prompt there); the assistant prefix is the generation prompt.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict[str, str]], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    try:
        user_only = render([{"role": "user", "content": _U1}])
        with_gen = render([{"role": "user", "content": _U1}], gen=True)
        one_turn = render([{"role": "user", "content": _U1}, {"role": "assistant", "content": _A1}])
        two_turns = render([
            {"role": "user", "content": _U1},
            {"role": "assistant", "content": _A1},
            {"role": "user", "content": _U2},
        ])
        with_system = render([{"role": "system", "content": _S}, {"role": "user", "content": _U1}])
    except Exception as exc:  # a template that refuses these shapes: no markers
        logger.info("chat template cannot be cut into role markers: %s", exc)
        return None
    if not with_gen.startswith(user_only) or not one_turn.startswith(with_gen + _A1):
        return None
    assistant_prefix = with_gen[len(user_only):]
    assistant_suffix = one_turn[len(with_gen) + len(_A1):]
    after_a1 = two_turns.find(_A1) + len(_A1) + len(assistant_suffix)
    if not two_turns[after_a1 - len(assistant_suffix): after_a1] == assistant_suffix:
        return None
    user_prefix = two_turns[after_a1: two_turns.find(_U2)]
    user_suffix = two_turns[two_turns.find(_U2) + len(_U2):]
    u1 = user_only.find(_U1)
    if user_only[u1 + len(_U1):] != user_suffix or not user_only[:u1].endswith(user_prefix):
        return None
    default_head = user_only[: u1 - len(user_prefix)]
    s = with_system.find(_S)
    u1s = with_system.find(_U1)
    if s < 0 or u1s < 0 or not with_system[:u1s].endswith(user_prefix):
        return None
    system_prefix = with_system[:s]
    system_suffix = with_system[s + len(_S): u1s - len(user_prefix)]
    return {
        "system": [system_prefix, system_suffix],
        "user": [user_prefix, user_suffix],
        "assistant": [assistant_prefix, assistant_suffix],
        "default_head": default_head,
    }
