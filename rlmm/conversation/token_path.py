"""`token_path=`: which ids the sampler reads at each turn of a conversation, and which ids the trainer scores.

In a multi-turn rollout the sampler emits token ids, the environment answers in text, and the next turn needs ids
again. Three ways to get them, one class each (the anchors' own code, read and run: docs/multi_turn.md):

- `tokens` (`TokenInTokenOut`): token-in/token-out. The sampler reads its own earlier ids and the environment's
  text tokenized once and appended; the trainer scores exactly those ids. The environment's ids are the chat
  template's rendering of its messages after a fixed dummy conversation, cut after the dummy's last end-of-turn
  token so that what the template writes after it (ChatML's newline) belongs to the environment (TRL's token mode
  before PR #6250, `_get_tool_suffix_ids`; verl's Continuous Token builders, SkyRL's default generator).
- `retokenize` (`Retokenize`): every turn the conversation is rendered by the chat template and tokenized from
  text, for the sampler's next prompt and, at the end, for the trainer, which scores the whole re-rendered
  conversation with the loss on the assistant turns (SkyRL's `retokenize_chat_history`; verl's SGLang message path,
  which re-renders assistant turns whose tool calls it parsed). The sampled ids are gone: the sampler's log-probs of
  the re-rendered ids come from the sampler's own prefill over them (verl's `calculate_log_probs` re-run of the
  engine on the final ids), so the importance ratio sees the numerics only, never the re-tokenization.
- `realign` (`Realign`): the sampler reads the re-rendered conversation (as in `retokenize`), and the trainer's row
  is built turn by turn from what the sampler read and sampled, as TRL's message-mode reconciler does
  (`trl/experimental/async_grpo/async_rollout_worker.py::_chain_to_sequences`, PR #6250): the row so far and the next
  prompt share a longest common token prefix; where they agree the turn is CLEAN and the prompt's new tail is
  appended as context; where the row's tail differs (a sampled turn re-rendered otherwise) the row is cut at the
  divergence and the prompt's tail replaces it, masked with log-prob 0 (REALIGN). So the trainer scores what the
  sampler read, and the sampled tokens that survive keep their log-probs. Where TRL starts a new row (FORK: the
  divergence lies before the last response, or leaves `fork_threshold_tokens` or more behind), rlmm realigns in the
  one row and counts the turn as a fork: one row per conversation keeps GRPO's groups, and the tokens TRL would have
  trained in the row it closes are masked instead. slime's builder (PR #2005)
  differs in two ways: it overwrites from the start of the last response (masking all of it, not only its drifted
  tail), and gates REALIGN on the new turn's length. NeMo-RL's `replace_prefix_tokens` is the opposite choice: it
  keeps every sampled id and takes the template only after the last end-of-turn token, which is `tokens` here.

Each path also measures the drift it faces (`TurnDrift`): every assistant turn's sampled ids against the same turn
re-rendered from its messages (the template's rendering of its history with and without it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from rlmm.policy.rollouts import KeptTokens

# What a turn's classes are called in the metrics (TRL's DriftKind, lower case).
CLEAN, REALIGN, FORK = "clean", "realign", "fork"


@dataclass
class Turn:
    """One policy turn as the sampler lived it: the ids it read, the ids it sampled (its end-of-turn token included
    when it stopped on one), their log-probs, why it stopped, and the kept sets of a truncating sampler."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: torch.Tensor  # float32 [len(output_ids)]
    finish: str  # "stop" | "length"
    kept: KeptTokens | None = None
    # An MoE sampler's experts of this generate call's row (`Rollouts.routed_experts`: [prompt + output, MoE layers,
    # top-k], entry p the experts of the forward whose input was token p; None: not captured)
    routed: torch.Tensor | None = None


@dataclass
class Conversation:
    """One conversation in flight: its messages (the first ones, then each assistant turn's text and the
    environment's answers), its turns, the environment's per-turn rewards and tool outcomes, and why it ended."""

    messages: list[dict]
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # the environment's reward of each turn
    tool_statuses: list[str] = field(default_factory=list)  # each tool call's ToolResult.status
    finish: str | None = None  # None while it goes on; stop | length | turns | context
    next_prompt: list[int] | None = None  # the ids the sampler reads next (the token path's), once the environment replied

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class TrainedRow:
    """What the trainer scores of one conversation: the first prompt's ids, the rest (the policy's turns and the
    environment's ids between them), which of those the policy sampled (trained, in the mismatch), their sampler
    log-probs (0 elsewhere), their kept sets (a truncating sampler's; the environment's ids keep only themselves)
    and each later turn's class (clean, realign, fork: `Realign`'s; clean for the others); the sampler's experts of
    every position where they were captured (`tokens` only: the other paths score ids the sampler's forwards did not
    all see)."""

    prompt_ids: list[int]
    response_ids: list[int]
    sampled: list[bool]
    logprobs: list[float]
    kept: KeptTokens | None
    kinds: list[str]
    routed: torch.Tensor | None = None


@dataclass(frozen=True)
class TurnDrift:
    """One assistant turn's sampled ids against the same turn re-rendered from its messages: the re-rendered ids
    (to their end-of-turn token), the length of the common prefix, and how many sampled tokens lie after it."""

    sampled: int  # tokens sampled
    rendered: int  # tokens of the re-rendered turn
    common: int  # longest common prefix

    @property
    def drifted(self) -> bool:
        return self.common != self.sampled or self.common != self.rendered

    @property
    def changed(self) -> int:
        """Sampled tokens after the first difference (what a realignment masks of this turn)."""
        return self.sampled - self.common


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@runtime_checkable
class TokenPath(Protocol):
    """The interface of the three options (module docstring; rlmm/run/interfaces.py re-exports it). `chat`: the bound
    template (rlmm/conversation/chat.py's `TemplatePrompts`)."""

    name: str
    rescores: bool  # the sampler's log-probs of the trained ids come from its prefill (`Retokenize`)

    def next_prompt(self, chat, conversation: Conversation) -> list[int]:
        """The ids the sampler reads for the conversation's next turn (its messages end with the environment's)."""
        ...

    def trained(self, chat, conversation: Conversation) -> TrainedRow:
        """The row the trainer scores of the finished conversation."""
        ...


class TokenInTokenOut:
    """`tokens`: the sampler's own ids, the environment's tokenized once (module docstring)."""

    name = "tokens"
    rescores = False

    def next_prompt(self, chat, conversation: Conversation) -> list[int]:
        last = conversation.turns[-1]
        return last.prompt_ids + last.output_ids + environment_ids(chat, conversation.messages)

    def trained(self, chat, conversation: Conversation) -> TrainedRow:
        first, last = conversation.turns[0], conversation.turns[-1]
        ids = last.prompt_ids + last.output_ids
        sampled, logprobs = [False] * len(ids), [0.0] * len(ids)
        kept: list = [None] * len(ids)
        for turn in conversation.turns:
            start = len(turn.prompt_ids)
            if ids[start:start + len(turn.output_ids)] != turn.output_ids:
                raise RuntimeError("token_path=tokens: a turn's prompt does not extend the one before it")
            for i, lp in enumerate(turn.logprobs.tolist()):
                sampled[start + i], logprobs[start + i] = True, lp
            for i, ids_kept in enumerate(kept_sets(turn)):
                kept[start + i] = ids_kept
        trained = row(ids, len(first.prompt_ids), sampled, logprobs, kept, [CLEAN] * (len(conversation.turns) - 1))
        trained.routed = stitched_routing(conversation.turns)
        return trained


class Retokenize:
    """`retokenize`: the conversation re-rendered and tokenized from text every turn and for the trainer, the loss on
    the assistant turns, the sampler's log-probs from its prefill over them (module docstring)."""

    name = "retokenize"
    rescores = True

    def next_prompt(self, chat, conversation: Conversation) -> list[int]:
        return chat.encode(chat.render(conversation.messages, generation_prompt=True))

    def trained(self, chat, conversation: Conversation) -> TrainedRow:
        """The conversation through its last assistant turn, re-rendered (what the template writes after that turn
        included, as the anchors' rows have it): an environment's reply that no turn answered (a conversation ended
        by its context) is not trained on, and would make the row longer than the context the sampler's re-scoring
        prefill holds (the last prompt, a whole turn and the one position past them)."""
        last = max(i for i, m in enumerate(conversation.messages) if m["role"] == "assistant")
        messages = conversation.messages[:last + 1]
        ids = chat.encode(chat.render(messages, generation_prompt=False))
        first = len(conversation.turns[0].prompt_ids)
        if ids[:first] != conversation.turns[0].prompt_ids:
            raise ValueError("token_path=retokenize: the whole conversation re-rendered does not begin with its first "
                             "prompt (the chat template is not prefix-stable; allowed: token_path=realign)")
        sampled = [False] * len(ids)
        for start, end in assistant_spans(chat, messages, ids):
            sampled[start:end] = [True] * (end - start)
        return row(ids, first, sampled, [0.0] * len(ids), None, [CLEAN] * (len(conversation.turns) - 1))


class Realign:
    """`realign`: the re-rendered conversation for the sampler, TRL's longest-common-prefix reconciler for the
    trainer, in one row (module docstring).

    Args:
        fork_threshold_tokens: TRL's: a turn whose row diverges from its prompt by this many tokens or more is a fork
            (there a new row; here the same realignment, counted in `token_path/frac_turns_fork`).
    """

    name = "realign"
    rescores = False

    def __init__(self, fork_threshold_tokens: int):
        if isinstance(fork_threshold_tokens, bool) or not isinstance(fork_threshold_tokens, int) \
                or fork_threshold_tokens < 1:
            raise ValueError(f"token_path.fork_threshold_tokens: must be an integer >= 1, got {fork_threshold_tokens!r}")
        self.fork_threshold_tokens = fork_threshold_tokens

    def next_prompt(self, chat, conversation: Conversation) -> list[int]:
        return chat.encode(chat.render(conversation.messages, generation_prompt=True))

    def trained(self, chat, conversation: Conversation) -> TrainedRow:
        ids, sampled, logprobs, kept, kinds = reconcile(conversation.turns, self.fork_threshold_tokens)
        return row(ids, len(conversation.turns[0].prompt_ids), sampled, logprobs, kept, kinds)


def reconcile(turns: list[Turn], fork_threshold_tokens: int = 1024) -> tuple[list[int], list[bool], list[float], list,
                                                                             list[str]]:
    """TRL's `_SampleBuilder` over a conversation's turns, in one row: (ids, sampled mask, log-probs, kept sets, the
    class of every turn after the first). A turn whose prompt extends the row is CLEAN (its new tail appended as
    context); otherwise the row is cut at the longest common prefix and the prompt's tail put in its place as
    context, log-prob 0: REALIGN when the cut lies in the last response and leaves fewer than
    `fork_threshold_tokens` of the row behind, else FORK (where TRL starts a new row)."""
    ids: list[int] = []
    sampled: list[bool] = []
    logprobs: list[float] = []
    kept: list = []
    kinds: list[str] = []
    last_response = None
    for turn in turns:
        matched = common_prefix(ids, turn.prompt_ids)
        if last_response is not None:
            drift = len(ids) - matched
            kinds.append(CLEAN if drift == 0 else REALIGN if matched >= last_response and drift < fork_threshold_tokens
                         else FORK)
        tail = turn.prompt_ids[matched:]
        del ids[matched:], sampled[matched:], logprobs[matched:], kept[matched:]
        ids += tail
        sampled += [False] * len(tail)
        logprobs += [0.0] * len(tail)
        kept += [None] * len(tail)
        last_response = len(ids)
        ids += turn.output_ids
        sampled += [True] * len(turn.output_ids)
        logprobs += turn.logprobs.tolist()
        kept += kept_sets(turn)
    return ids, sampled, logprobs, kept, kinds


def row(ids: list[int], prompt_length: int, sampled: list[bool], logprobs: list[float], kept: list | None,
        kinds: list[str]) -> TrainedRow:
    """A TrainedRow from whole-row lists (the prompt's part dropped), kept sets where a truncating sampler gave them
    (a position without one, the environment's or a replaced one, keeps only its own token)."""
    response = ids[prompt_length:]
    if any(sampled[:prompt_length]):
        raise RuntimeError("a sampled token inside the first prompt")
    kept_row = None
    if kept is not None and any(k is not None for k in kept[prompt_length:]):
        kept_row = KeptTokens.of_sets([k if k is not None else [token] for k, token in
                                       zip(kept[prompt_length:], response)], [False] * len(response))
    return TrainedRow(ids[:prompt_length], response, sampled[prompt_length:], logprobs[prompt_length:], kept_row,
                      kinds)


def stitched_routing(turns: list[Turn]) -> torch.Tensor | None:
    """The experts of every position of a token-in/token-out row ([prompt + response, MoE layers, top-k]), each taken
    from the forward that first fed the token to the sampler as it sampled: the first prompt's from the first turn's
    prefill; a turn's sampled tokens but its last from that turn's decode steps; its last (the end-of-turn token, never
    fed back while it was sampled) and the environment's tokens after it from the next turn's prefill; the row's last
    token NO_ROUTE, as in a single response (rlmm/policy/rollouts.py). None when a turn has none."""
    if not turns or any(turn.routed is None for turn in turns):
        return None
    parts = [turns[0].routed[:len(turns[0].prompt_ids)]]
    for turn, following in zip(turns, [*turns[1:], None]):
        start, end = len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.output_ids)
        if following is None:
            parts.append(turn.routed[start:end])
        else:
            parts += [turn.routed[start:end - 1], following.routed[end - 1:len(following.prompt_ids)]]
    return torch.cat(parts)


def kept_sets(turn: Turn) -> list:
    """Each sampled position's kept set (a list of ids), or None per position when the sampler did not truncate."""
    if turn.kept is None:
        return [None] * len(turn.output_ids)
    offsets, ids = turn.kept.offsets.tolist(), turn.kept.ids.tolist()
    return [ids[offsets[t]:offsets[t + 1]] for t in range(len(turn.output_ids))]


def environment_ids(chat, messages: list[dict]) -> list[int]:
    """The ids of the messages after the conversation's last assistant turn, and the generation prompt after them,
    as the chat template renders them after a fixed dummy exchange (TRL's `_get_tool_suffix_ids`): the dummy's
    rendering cut after its last end-of-turn token, so the template's text after that token (ChatML's newline) is
    the environment's, not the policy's."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
    prefix = chat.encode(chat.render(dummy, generation_prompt=False))
    eos = chat.tokenizer.eos_token_id
    if eos in prefix:
        prefix = prefix[:len(prefix) - prefix[::-1].index(eos)]
    full = chat.encode(chat.render(dummy + messages[last + 1:], generation_prompt=True))
    if full[:len(prefix)] != prefix:
        raise ValueError("token_path=tokens: the chat template does not render a conversation as a prefix of the same "
                         "conversation with a message more, so the environment's ids cannot be cut from it "
                         "(allowed: token_path=retokenize or realign)")
    return full[len(prefix):]


def assistant_spans(chat, messages: list[dict], ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each assistant turn in `ids` (the whole conversation rendered and encoded), from the turn's
    rendering with its history (`render(messages[:i], generation_prompt=True)`) and without, cut after its
    end-of-turn token (what the template writes after it is not the policy's)."""
    spans = []
    eos = chat.tokenizer.eos_token_id
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(chat.encode(chat.render(messages[:i], generation_prompt=True)))
        through = chat.encode(chat.render(messages[:i + 1], generation_prompt=False))
        if ids[:len(through)] != through:
            raise ValueError("token_path=retokenize: the chat template renders an earlier turn differently once later "
                             "turns follow (it is not prefix-stable: e.g. it drops earlier reasoning), so the assistant "
                             "turns cannot be located in the whole conversation (allowed: token_path=realign)")
        turn = through[start:]
        end = start + (len(turn) - turn[::-1].index(eos) if eos in turn else len(turn))
        spans.append((start, end))
    return spans


def turn_drift(chat, conversation: Conversation) -> list[TurnDrift]:
    """Each assistant turn's sampled ids against its re-rendering: the turn's messages rendered with its history and
    without (`assistant_spans`' rule, on the conversation up to that turn), to its end-of-turn token."""
    drifts = []
    assistant = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    eos = chat.tokenizer.eos_token_id
    for turn, i in zip(conversation.turns, assistant):
        history = conversation.messages[:i]
        start = len(chat.encode(chat.render(history, generation_prompt=True)))
        rendered = chat.encode(chat.render(conversation.messages[:i + 1], generation_prompt=False))[start:]
        if eos in rendered:
            rendered = rendered[:len(rendered) - rendered[::-1].index(eos)]
        drifts.append(TurnDrift(len(turn.output_ids), len(rendered), common_prefix(turn.output_ids, rendered)))
    return drifts
