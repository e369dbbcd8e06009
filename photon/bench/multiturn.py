"""The multi-turn chat workload of `photon bench serve --dataset-name multiturn` (pure parts).

`num_conversations` conversations of `num_turns` turns each. Conversations are split into
`num_groups` contiguous groups of (nearly) equal size; the conversations of a group share one
system prompt of `system_prompt_len` tokens (different groups have different ones). Every turn
sends a new user message of `turn_len` tokens; its prompt is the system prompt, the history (each
earlier user message and the model's actual answer to it, as it arrived) and the new message, so
turn k's prompt extends turn k - 1's prompt and answer: a prefix cache that kept them reuses all
of it. Texts are seeded random common words, cut to their exact token counts when a tokenizer is
at hand (`fit_plans`); on the completions endpoint the messages are rendered as a plain transcript
(`render_transcript`) that keeps that prefix property in text.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from photon.bench.serve_workload import COMMON_WORDS

Message = dict[str, str]
# A text's first n tokens (encode, cut, decode); the words as they are when None.
Fitter = Callable[[str, int], Awaitable[str]]


@dataclass(frozen=True)
class MultiTurnOptions:
    num_conversations: int = 64
    num_turns: int = 6
    system_prompt_len: int = 2048  # tokens
    num_groups: int = 16  # distinct system prompts; conversations are split among them
    turn_len: int = 64  # tokens of each user message
    output_len: int = 128  # tokens of each answer (EOS ignored)
    seed: int = 0

    def check(self) -> None:
        """ValueError naming the flag when an option is out of range."""
        for flag, value, low in (("--num-conversations", self.num_conversations, 1),
                                 ("--num-turns", self.num_turns, 1),
                                 ("--system-prompt-len", self.system_prompt_len, 0),
                                 ("--num-groups", self.num_groups, 1),
                                 ("--turn-len", self.turn_len, 1),
                                 ("--output-len", self.output_len, 1)):
            if value < low:
                raise ValueError(f"{flag} must be at least {low}, got {value}")
        if self.num_groups > self.num_conversations:
            raise ValueError(f"--num-groups ({self.num_groups}) cannot exceed "
                             f"--num-conversations ({self.num_conversations}): every group "
                             "needs a conversation")

    @property
    def num_requests(self) -> int:
        return self.num_conversations * self.num_turns


@dataclass(frozen=True)
class ConversationPlan:
    index: int
    group: int
    system_prompt: str  # "" when system_prompt_len is 0
    user_messages: tuple[str, ...]  # one per turn


def group_of(conversation: int, opts: MultiTurnOptions) -> int:
    """The group of a conversation: contiguous runs of nearly equal size, so the members of
    a group start close together."""
    return conversation * opts.num_groups // opts.num_conversations


def word_text(rng: random.Random, num_words: int) -> str:
    """`num_words` seeded common words (most are one token in BPE vocabularies)."""
    return " ".join(rng.choice(COMMON_WORDS) for _ in range(num_words))


def plan_conversations(opts: MultiTurnOptions) -> list[ConversationPlan]:
    """Every conversation's system prompt and user messages, from the seed alone. Each user
    message starts with its conversation and turn number, so no two prompts are equal."""
    opts.check()
    rng = random.Random(opts.seed)
    systems = [word_text(rng, opts.system_prompt_len) for _ in range(opts.num_groups)]
    plans = []
    for c in range(opts.num_conversations):
        messages = tuple(f"[{c}.{t}] " + word_text(rng, opts.turn_len)
                         for t in range(opts.num_turns))
        plans.append(ConversationPlan(c, group_of(c, opts), systems[group_of(c, opts)], messages))
    return plans


async def fit_plans(plans: Sequence[ConversationPlan], opts: MultiTurnOptions,
                    fit: Fitter) -> list[ConversationPlan]:
    """The plans with each text cut to its token count (system prompts once per group)."""
    systems: dict[int, str] = {}
    out = []
    for plan in plans:
        if plan.group not in systems:
            systems[plan.group] = (await fit(plan.system_prompt, opts.system_prompt_len)
                                   if plan.system_prompt else "")
        users = tuple([await fit(m, opts.turn_len) for m in plan.user_messages])
        out.append(replace(plan, system_prompt=systems[plan.group], user_messages=users))
    return out


def turn_messages(plan: ConversationPlan, answers: Sequence[str]) -> list[Message]:
    """The chat messages of turn len(answers): the system prompt, every earlier user message
    with the answer it got, then the new user message."""
    turn = len(answers)
    if turn >= len(plan.user_messages):
        raise ValueError(f"conversation {plan.index} has {len(plan.user_messages)} turns; "
                         f"turn {turn} does not exist")
    messages = [{"role": "system", "content": plan.system_prompt}] if plan.system_prompt else []
    for user, answer in zip(plan.user_messages, answers):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": plan.user_messages[turn]})
    return messages


_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_transcript(messages: Sequence[Message]) -> str:
    """A completions prompt: one paragraph per message and an open "Assistant:" at the end.
    An answer is appended right after its "Assistant:" as the model wrote it, so each turn's
    transcript starts with the previous turn's prompt followed by its answer."""
    parts = []
    for m in messages:
        sep = "" if m["role"] == "assistant" else " "
        parts.append(f"{_ROLES[m['role']]}:{sep}{m['content']}")
    return "\n\n".join(parts) + "\n\nAssistant:"
