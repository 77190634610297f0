"""Episodes: how a task's examples become rollouts and rewards, one response each (`SingleTurn`) or a conversation
with an environment (`MultiTurn`, for a task of rlmm/tasks/environment.py). The RL step, the evaluation and the
delay line call the same three methods whichever they hold.

A multi-turn conversation, turn by turn (`MultiTurn.sample`): the sampler answers every active conversation's next
prompt (the token path's, rlmm/conversation/token_path.py); each answer is decoded to text and becomes an assistant
message; the environment replies (a tool's result, or `done` when the policy answered) and its message is appended;
a conversation ends when the policy answers (`stop`), a turn stops at `sampling.max_new_tokens` without its
end-of-turn token (`length`: its text is the answer), it has taken `task.max_turns` turns (`turns`: still calling a
tool, no answer) or its next prompt and a full turn would not fit `task.max_context_tokens` (`context`). Every
rank makes the same sampling calls (a turn no row of its own needs is an empty call), so each call's seeds are
those of the one-rank run; greedy conversations (the evaluation's, on rank 0 alone) take no collective. Then the token path turns each conversation into the row the trainer scores, and the
reward is the task's on the last assistant message plus the environment's per-turn rewards.
"""
from __future__ import annotations

import math

import torch

from rlmm.conversation.token_path import Conversation, TokenPath, Turn, TurnDrift, turn_drift
from rlmm.mismatch.metrics import turn_boundary_metrics
from rlmm.policy.rollouts import Rollouts
from rlmm.runtime.collectives import any_rank
from rlmm.tasks.environment import is_multi_turn

FINISH_REASONS = ("stop", "length", "turns", "context")


def task_reward(task, example, completion: str) -> float:
    """The task's reward; when the task's function raises, a one-line error naming the prompt."""
    try:
        return float(task.reward(example, completion))
    except Exception as err:
        raise ValueError(f"task.reward raised {type(err).__name__} ({err}) on prompt {example.prompt!r} with "
                         f"completion {completion!r}") from None


class SingleTurn:
    """One response per prompt: the sampler's rollouts as they are, rewarded on their decoded text."""

    multi_turn = False

    def __init__(self, task, prompts, tokenizer, max_new_tokens: int):
        self.task, self.prompts, self.tokenizer = task, prompts, tokenizer
        self.max_sampled_tokens = max_new_tokens  # the most tokens a row's policy samples (DAPO's overlong length)
        self.max_response_tokens = max_new_tokens  # the widest response row (the loss's max_length)

    def prompt_ids(self, examples: list) -> list[list[int]]:
        return [self.prompts.ids(e) for e in examples]

    def sample(self, sampler, examples: list, *, n: int = 1, greedy: bool = False,
               request_ids: list[int] | None = None) -> Rollouts:
        return sampler.generate(self.prompt_ids(examples), n=n, greedy=greedy, request_ids=request_ids)

    def rewards(self, examples: list, rollouts: Rollouts, n: int) -> torch.Tensor:
        """[B] rewards of rows grouped `n` to an example, in the examples' order."""
        texts = self.tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)
        return torch.tensor([task_reward(self.task, examples[i // n], t) for i, t in enumerate(texts)])

    def accuracy(self, examples: list, rollouts: Rollouts) -> float:
        return self.rewards(examples, rollouts, 1).mean().item()

    def metrics(self, rollouts: Rollouts, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                mask: torch.Tensor) -> dict[str, float]:
        """Nothing: a single response has no turns."""
        return {}


class MultiTurn:
    """Conversations with the task's environment (module docstring). `max_context_tokens`: the task's limit;
    `token_path`: which ids the sampler reads and the trainer scores."""

    multi_turn = True

    def __init__(self, task, prompts, tokenizer, max_new_tokens: int, token_path: TokenPath):
        self.task, self.prompts, self.tokenizer, self.path = task, prompts, tokenizer, token_path
        self.max_new_tokens = max_new_tokens
        self.max_context = task.max_context_tokens
        self.max_sampled_tokens = task.max_turns * max_new_tokens  # the most tokens a row's policy samples
        # The widest response row (the loss's max_length): every turn's prompt and answer fit the context, so the ids
        # after the first prompt (the environment's between the turns included) do too; max_turns x max_new_tokens
        # would not hold them.
        self.max_response_tokens = task.max_context_tokens

    def prompt_ids(self, examples: list) -> list[list[int]]:
        return [self.prompts.ids(e) for e in examples]

    def sample(self, sampler, examples: list, *, n: int = 1, greedy: bool = False,
               request_ids: list[int] | None = None) -> Rollouts:
        places = list(range(len(examples))) if request_ids is None else list(request_ids)
        first = self.prompt_ids(examples)
        rows = [(examples[i // n], Conversation(self.prompts.first_messages(examples[i // n])))
                for i in range(len(examples) * n)]
        out = sampler.generate(first, n=n, greedy=greedy, request_ids=places)
        self._take(rows, list(range(len(rows))), out)
        # Later turns: each row is its own request, placed by its row in the step (place x n + sample). A sampling
        # turn is taken on every rank while any rank has a conversation going (each call's seeds are the one-rank
        # run's); greedy ones draw nothing and count no call, and only rank 0 evaluates: no collective there.
        requests = [places[i // n] * n + i % n for i in range(len(rows))]
        going = (lambda: any(not c.done for _, c in rows)) if greedy else \
            (lambda: any_rank(any(not c.done for _, c in rows)))
        while going():
            active = [i for i, (_, c) in enumerate(rows) if not c.done]
            prompts = [rows[i][1].next_prompt for i in active]
            out = sampler.generate(prompts, n=1, greedy=greedy, request_ids=[requests[i] for i in active])
            self._take(rows, active, out)
        return self._rollouts(sampler, rows, greedy)

    def _take(self, rows: list, indices: list[int], out: Rollouts) -> None:
        """Append each sampled turn to its conversation, then the environment's reply, and end what has ended."""
        for k, i in enumerate(indices):
            example, conversation = rows[i]
            turn = Turn(out.prompt_ids[k], out.response_ids[k], out.sampler_logprobs[k], out.finish_reasons[k],
                        None if out.kept_tokens is None else out.kept_tokens[k],
                        None if out.routed_experts is None else out.routed_experts[k])
            conversation.turns.append(turn)
            conversation.messages.append({"role": "assistant", "content": self.prompts.decode(turn.output_ids)})
            if turn.finish == "length":
                conversation.finish = "length"
                continue
            reply = self.task.reply(example, conversation.messages)
            conversation.rewards.append(reply.reward)
            if reply.tool is not None:
                conversation.tool_statuses.append(reply.tool.status)
            if reply.done:
                conversation.finish = "stop"
            elif len(conversation.turns) >= self.task.max_turns:
                conversation.finish = "turns"
            else:
                conversation.messages.append(reply.message)
                conversation.next_prompt = self.path.next_prompt(self.prompts, conversation)
                if len(conversation.next_prompt) + self.max_new_tokens > self.max_context:
                    conversation.finish = "context"

    def _rollouts(self, sampler, rows: list, greedy: bool) -> Rollouts:
        """The trainer's rows of the conversations (greedy ones, an evaluation's, are not re-scored)."""
        trained = [self.path.trained(self.prompts, c) for _, c in rows]
        logprobs = [torch.tensor(r.logprobs, dtype=torch.float32) for r in trained]
        if self.path.rescores and trained and not greedy:  # the sampler's log-probs of ids it never sampled: its prefill
            rescored = sampler.prefill_logprobs([r.prompt_ids for r in trained], [r.response_ids for r in trained])
            logprobs = [torch.where(torch.tensor(r.sampled), lp.float(), 0.0) for r, lp in zip(trained, rescored)]
        kept = [r.kept for r in trained]
        records = []
        for (example, c), r in zip(rows, trained):
            drift = turn_drift(self.prompts, c)
            records.append({"messages": c.messages, "finish": c.finish, "turns": len(c.turns),
                            "turn_rewards": c.rewards, "tool_statuses": c.tool_statuses, "kinds": r.kinds,
                            "drift": [(d.sampled, d.rendered, d.common) for d in drift]})
        routed = [r.routed for r in trained]
        return Rollouts([r.prompt_ids for r in trained], [r.response_ids for r in trained], logprobs,
                        [c.finish for _, c in rows],
                        kept_tokens=kept if any(k is not None for k in kept) else None,
                        routed_experts=routed if trained and all(r is not None for r in routed) else None,
                        sampled=[torch.tensor(r.sampled, dtype=torch.bool) for r in trained], conversations=records)

    def rewards(self, examples: list, rollouts: Rollouts, n: int) -> torch.Tensor:
        """[B] the task's reward of each conversation's last assistant message plus the environment's turn rewards."""
        return torch.tensor([task_reward(self.task, examples[i // n], answer(record)) + sum(record["turn_rewards"])
                             for i, record in enumerate(rollouts.conversations)])

    def accuracy(self, examples: list, rollouts: Rollouts) -> float:
        """The share of conversations whose answer (the last assistant message) the task scores 1."""
        return sum(task_reward(self.task, e, answer(r)) for e, r in zip(examples, rollouts.conversations)) / len(examples)

    def metrics(self, rollouts: Rollouts, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                mask: torch.Tensor) -> dict[str, float]:
        """A batch's conversation/ (turns, finish reasons, tool outcomes), token_path/ (drift) and the mismatch at
        the turns' edges (mismatch/, `turn_boundary_metrics`), from the [B, T] log-probs of the sampled tokens
        (`mask`). docs/metrics.md."""
        records = rollouts.conversations
        turns = [r["turns"] for r in records]
        statuses = [s for r in records for s in r["tool_statuses"]]
        drift = [TurnDrift(*d) for r in records for d in r["drift"]]
        drifted = [d for d in drift if d.drifted]
        kinds = [k for r in records for k in r["kinds"]]
        sampled = sum(d.sampled for d in drift)
        out = {"conversation/turns_mean": sum(turns) / len(turns), "conversation/turns_max": float(max(turns)),
               **{f"conversation/frac_{reason}": sum(r["finish"] == reason for r in records) / len(records)
                  for reason in FINISH_REASONS},
               "conversation/tool_calls_mean": len(statuses) / len(records),
               **{f"conversation/frac_tool_{status}": (statuses.count(status) / len(statuses) if statuses else 0.0)
                  for status in ("error", "timeout", "garbage")},
               "token_path/frac_turns_drifted": len(drifted) / len(drift) if drift else 0.0,
               "token_path/first_drift_position_mean": (sum(d.common for d in drifted) / len(drifted) if drifted
                                                        else math.nan),
               "token_path/frac_tokens_changed": sum(d.changed for d in drift) / sampled if sampled else 0.0}
        if kinds:
            out.update({f"token_path/frac_turns_{kind}": kinds.count(kind) / len(kinds) for kind in ("realign", "fork")})
        edges = turn_boundary_metrics(trainer_logprobs, sampler_logprobs, mask)
        return out | {f"mismatch/{k}": v for k, v in edges.items()}


def answer(record: dict) -> str:
    """A conversation's answer: its last assistant message."""
    return next(m["content"] for m in reversed(record["messages"]) if m["role"] == "assistant")


def build_episodes(task, prompts, tokenizer, max_new_tokens: int, token_path: TokenPath):
    """`MultiTurn` for a task with an environment, else `SingleTurn` (`check_token_path` first)."""
    check_token_path(task, token_path)
    if is_multi_turn(task):
        return MultiTurn(task, prompts, tokenizer, max_new_tokens, token_path)
    return SingleTurn(task, prompts, tokenizer, max_new_tokens)


def check_token_path(task, token_path: TokenPath) -> None:
    """A token path other than `tokens` for a single-turn task, refused: a single response has no conversation to
    re-render."""
    if not is_multi_turn(task) and token_path.name != "tokens":
        raise ValueError(f"token_path={token_path.name}: the task answers in one response, with no conversation to "
                         f"re-render (allowed: token_path=tokens, or a multi-turn task such as task=calculator)")
