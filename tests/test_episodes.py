"""rlmm/run/episodes.py: conversations with the environment, turn by turn, on a scripted sampler (the
policy's turns given, the rest real: the char model's chat template, the calculator task's environment, the token
paths), so every limit and record can be checked exactly."""
import math

import pytest
import torch

from rlmm.conversation.chat import ChatTemplate, NoChatTemplate
from rlmm.run.episodes import MultiTurn, SingleTurn, build_episodes
from rlmm.conversation.token_path import Realign, Retokenize, TokenInTokenOut
from rlmm.models.tiny import build_char_tokenizer
from rlmm.policy.rollouts import Rollouts
from rlmm.tasks import ArithmeticTask
from test_tools import calculator_task


class ScriptedSampler:
    """Answers a prompt with `script(text of the prompt, turn)` (a turn's text; a trailing "…" means the turn runs
    out of tokens: no end-of-turn token), log-prob -0.1 a token; counts its calls as a sampler does."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls, self.requests = tokenizer, script, 0, []

    def generate(self, prompt_ids, *, n=1, greedy=False, request_ids=None, max_new_tokens=None):
        self.calls += not greedy
        self.requests.append(list(request_ids or []))
        out = Rollouts([], [], [], [])
        for prompt in prompt_ids:
            text = self.tokenizer.decode(prompt)
            for _ in range(n):
                answer = self.script(text)
                ids = self.tokenizer.encode(answer.rstrip("…"), add_special_tokens=False)
                stop = not answer.endswith("…")
                ids += [self.tokenizer.eos_token_id] if stop else []
                out.prompt_ids.append(list(prompt))
                out.response_ids.append(ids)
                out.sampler_logprobs.append(torch.full((len(ids),), -0.1))
                out.finish_reasons.append("stop" if stop else "length")
        return out

    def prefill_logprobs(self, prompt_ids, response_ids):
        return [torch.full((len(r),), -0.2) for r in response_ids]


def demonstrated(task):
    """A policy that answers as the task's demonstrations do (the calculator for each operation, then the answer)."""
    examples = {e.prompt: e for e in task.examples("train", 200)}

    def script(text):
        prompt = text.removeprefix("<bos>").split("=", 1)[0] + "="
        demo = [m["content"] for m in task.demonstration(examples[prompt]) if m["role"] == "assistant"]
        return demo[text.count("<eos>")]
    return script, list(examples.values())


def episodes(task, path=TokenInTokenOut(), tokenizer=None):
    tokenizer = tokenizer or build_char_tokenizer()
    return MultiTurn(task, ChatTemplate(required=False).bind(tokenizer, "char", task), tokenizer, 16, path), tokenizer


@pytest.mark.parametrize("path", [TokenInTokenOut(), Retokenize(), Realign(1024)], ids=lambda p: p.name)
def test_a_demonstrated_policy_solves_every_problem_with_the_calculator(path):
    """Each conversation takes three turns (two calls, the answer) and stops; its row is the demonstration rendered
    (the character model re-renders exactly what it sampled: no drift), the policy's turns and end-of-turn tokens
    sampled, the environment's bracketed results not; reward 1."""
    task = calculator_task()
    multi, tokenizer = episodes(task, path)
    script, examples = demonstrated(task)
    examples = [e for e in examples if e.prompt.startswith("(")][:4]
    sampler = ScriptedSampler(tokenizer, script)
    rollouts = multi.sample(sampler, examples, n=2, request_ids=[0, 1, 2, 3])
    assert len(rollouts) == 8 and rollouts.finish_reasons == ["stop"] * 8 and sampler.calls == 3
    assert multi.rewards(examples, rollouts, 2).tolist() == [1.0] * 8
    for i, record in enumerate(rollouts.conversations):
        demo = task.demonstration(examples[i // 2])
        assert [m["content"] for m in record["messages"]] == [m["content"] for m in demo]
        ids = rollouts.prompt_ids[i] + rollouts.response_ids[i]
        assert tokenizer.decode(ids) == multi.prompts.render(demo, generation_prompt=False)
        sampled = "".join(tokenizer.decode([t]) for t, s in zip(rollouts.response_ids[i], rollouts.sampled[i]) if s)
        assert sampled == "".join(m["content"] + "<eos>" for m in demo if m["role"] == "assistant")
        expected = -0.2 if path.rescores else -0.1
        assert rollouts.sampler_logprobs[i][rollouts.sampled[i]].tolist() == pytest.approx([expected] *
                                                                                           int(rollouts.sampled[i].sum()))
        assert (rollouts.sampler_logprobs[i][~rollouts.sampled[i]] == 0).all()
    # Later turns: one request per row, placed by its row in the step (place x n + sample)
    assert sampler.requests == [[0, 1, 2, 3], list(range(8)), list(range(8))]
    logprobs, mask = rollouts.padded_sampler_logprobs()
    # the mask every stage trains and measures on: the sampled tokens, not the environment's between them
    assert mask.sum().item() == sum(int(s.sum()) for s in rollouts.sampled) < sum(map(len, rollouts.response_ids))
    metrics = multi.metrics(rollouts, logprobs, logprobs, mask)
    assert metrics["conversation/turns_mean"] == 3 and metrics["conversation/frac_stop"] == 1
    assert metrics["conversation/tool_calls_mean"] == 2 and metrics["conversation/frac_tool_error"] == 0
    assert metrics["token_path/frac_turns_drifted"] == 0 and math.isnan(metrics["token_path/first_drift_position_mean"])
    assert metrics["mismatch/token_mult_prob_error_boundary"] == 1 and metrics["mismatch/token_mult_prob_error_generated"] == 1


def test_limits_end_a_conversation():
    """A policy that keeps calling stops at `max_turns` (`turns`, no answer: reward 0); a next prompt that would not
    leave a whole turn inside `max_context_tokens` ends it (`context`); a turn without its end-of-turn token ends it
    (`length`), its text the answer; a tool error is the environment's answer, recorded."""
    examples = calculator_task().examples("train", 2)

    def run(script, path=TokenInTokenOut(), **values):
        multi, tokenizer = episodes(calculator_task(**values), path)
        return multi, multi.sample(ScriptedSampler(tokenizer, script), examples)

    multi, rollouts = run(lambda text: "calc(1+1)", max_turns=2)
    assert rollouts.finish_reasons == ["turns"] * 2 and [r["turns"] for r in rollouts.conversations] == [2, 2]
    assert multi.rewards(examples, rollouts, 1).tolist() == [0.0, 0.0]
    # full-length calls: the response (two turns and the environment's ids between) is wider than max_turns x
    # max_new_tokens, within the width the loss is told (its max_length refuses a wider batch)
    multi, rollouts = run(lambda text: "calc(11+11+11)", max_turns=2)
    widest = max(map(len, rollouts.response_ids))
    assert widest > 2 * multi.max_new_tokens and widest <= multi.max_response_tokens
    _, rollouts = run(lambda text: "calc(1+1)", max_context_tokens=40)
    assert rollouts.finish_reasons == ["context"] * 2
    assert all(len(p) + len(r) <= 40 for p, r in zip(rollouts.prompt_ids, rollouts.response_ids))
    # a whole first turn and the long reply it gets overflow the context: every path's row (the trainer's, the
    # sampler's re-scoring prefill's) stays inside it, without the reply that no turn answered
    context = max(len(multi.prompts.ids(e)) for e in examples) + multi.max_new_tokens
    for path in (TokenInTokenOut(), Retokenize(), Realign(1024)):
        _, rollouts = run(lambda text: "calc(9999*9999)", path, max_context_tokens=context)
        assert rollouts.finish_reasons == ["context"] * 2 and [r["turns"] for r in rollouts.conversations] == [1, 1]
        assert all(len(p) + len(r) <= context + 1 for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)), \
            path.name  # + 1: the newline a template writes after the turn
        assert all(r["messages"][-1]["role"] == "tool" for r in rollouts.conversations)  # recorded, not trained
    _, rollouts = run(lambda text: "12…")
    assert rollouts.finish_reasons == ["length"] * 2 and rollouts.conversations[0]["messages"][-1]["content"] == "12"
    multi, rollouts = run(lambda text: "calc(1/0)" if text.count("<eos>") == 0 else "7")
    assert rollouts.conversations[0]["tool_statuses"] == ["error"]
    assert rollouts.conversations[0]["messages"][2]["content"].startswith("error: ZeroDivisionError")
    logprobs, mask = rollouts.padded_sampler_logprobs()
    assert multi.metrics(rollouts, logprobs, logprobs, mask)["conversation/frac_tool_error"] == 1


def test_greedy_conversations_score_the_answer():
    task = calculator_task()
    multi, tokenizer = episodes(task)
    script, examples = demonstrated(task)
    sampler = ScriptedSampler(tokenizer, script)
    rollouts = multi.sample(sampler, examples[:5], greedy=True)
    assert sampler.calls == 0 and multi.accuracy(examples[:5], rollouts) == 1.0


def test_single_turn_tasks_refuse_another_token_path_and_a_multi_turn_task_needs_a_template():
    task = ArithmeticTask(seed=0, min_value=0, max_value=9, operations=["+"], careless_demos=0.0)
    tokenizer = build_char_tokenizer()
    prompts = ChatTemplate(required=False).bind(tokenizer, "char", task)
    assert isinstance(build_episodes(task, prompts, tokenizer, 8, TokenInTokenOut()), SingleTurn)
    with pytest.raises(ValueError, match="^token_path=realign: the task answers in one response"):
        build_episodes(task, prompts, tokenizer, 8, Realign(1024))
    with pytest.raises(ValueError, match="^chat_template=none: a multi-turn task renders its turns"):
        NoChatTemplate().bind(tokenizer, "char", calculator_task())
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="^chat_template: the model at 'm' has no chat template and a multi-turn"):
        ChatTemplate(required=False).bind(tokenizer, "m", calculator_task())
    with pytest.raises(ValueError, match="^chat_template: the model at 'm' has no chat template and chat_template=model"):
        ChatTemplate(required=True).bind(tokenizer, "m", task)
    assert ChatTemplate(required=False).bind(tokenizer, "m", task).ids(task.examples("test", 1)[0])[0] == 1  # <bos>


def test_the_char_models_template_leaves_single_turn_prompts_as_they_were():
    """The built-in character model's chat template renders a user turn as its text: every arithmetic prompt is the
    same ids with the template as the tokenizer gives without it (the shipped models' runs are unchanged)."""
    task = ArithmeticTask(seed=0, min_value=0, max_value=99, operations=["+", "-", "*"], careless_demos=0.0)
    tokenizer = build_char_tokenizer()
    prompts = ChatTemplate(required=False).bind(tokenizer, "char", task)
    assert prompts.uses_template
    for example in task.examples("test", 300):
        assert prompts.ids(example) == tokenizer(example.prompt).input_ids
