"""Multi-turn tasks: an environment answers each of the policy's turns until the policy stops or a limit is hit.

A multi-turn task is a task (rlmm/tasks/base.py: `examples`, `reward`) that also has

- `first_messages(example) -> list[dict]`: the conversation before the policy's first turn (a system message
  where the task has one, then the user's question), chat-template messages ({"role", "content"});
- `reply(example, messages) -> Reply`: after each policy turn (the last message, role "assistant"), the
  environment's answer: a tool's result as a message of role "tool", or `done` (the policy answered);
- `tools`: the tools' JSON schemas the chat template is given (`apply_chat_template(tools=...)`), or None;
- `demonstration(example) -> list[dict]`: a whole conversation a warm start learns from (the built-in models);
- `max_turns`: the most policy turns a conversation may take (>= 1);
- `max_context_tokens`: a conversation goes on while its next prompt and a whole turn (`sampling.max_new_tokens`)
  fit in this many tokens;
- `environment_keys`: the names of its config keys that are the environment's limits (turns, context, a tool's
  timeout): they change no demonstration, so a warm-started built-in model does not depend on them.

`reward(example, completion)` scores the policy's last turn (its answer); a conversation's reward is that plus
the environment's per-turn rewards (`Reply.reward`, 0 where it gives none). The environment's text is never
trained on and never enters the mismatch metrics: the policy did not sample it (rlmm/conversation/).

How a policy calls a tool is the model's convention, not the task's: a `CallFormat` reads a call out of a
turn's text and writes one for a demonstration. `TerseCalls` is the built-in models' `calc(37*48)`;
`HermesCalls` is the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` of Qwen2.5/Qwen3 and most
instruct models whose chat template takes `tools` (Hermes function calling).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rlmm.tasks.base import Example
from rlmm.tasks.tools import ToolResult, run_tool


@dataclass(frozen=True)
class Reply:
    """The environment's answer to one policy turn: `message` (role "tool") when the conversation goes on,
    None when it is `done`; `reward` for this turn; `tool` how the tool call went (None: no tool was called)."""

    message: dict | None
    reward: float = 0.0
    tool: ToolResult | None = None

    @property
    def done(self) -> bool:
        return self.message is None


@runtime_checkable
class MultiTurnTask(Protocol):
    max_turns: int
    max_context_tokens: int
    environment_keys: tuple[str, ...]
    tools: list[dict] | None

    def examples(self, split: str, n: int) -> list[Example]: ...

    def reward(self, example: Example, completion: str) -> float: ...

    def first_messages(self, example: Example) -> list[dict]: ...

    def reply(self, example: Example, messages: list[dict]) -> Reply: ...

    def demonstration(self, example: Example) -> list[dict]: ...


def is_multi_turn(task) -> bool:
    """Whether `task` is answered by an environment turn after turn (`MultiTurnTask`), not in one response."""
    return isinstance(task, MultiTurnTask)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the tool's one argument as text (an expression, a program)


class TerseCalls:
    """`name(arguments)` as the whole turn (surrounding whitespace aside): `calc(37*48)`. Short, for the built-in
    tiny models, whose every character is a token (the character model) or a few (the BPE one)."""

    _CALL = re.compile(r"\s*([a-z_]+)\((.*)\)\s*", re.DOTALL)

    def parse(self, text: str) -> ToolCall | None:
        match = self._CALL.fullmatch(text)
        return None if match is None else ToolCall(match.group(1), match.group(2))

    def write(self, call: ToolCall) -> str:
        return f"{call.name}({call.arguments})"


class HermesCalls:
    """`<tool_call>{"name": NAME, "arguments": {ARGUMENT: VALUE}}</tool_call>` anywhere in the turn (the first one
    is made); `argument` names the one argument a tool takes (`{"expression": "37*48"}`). A call whose JSON does
    not parse is still a call, to a tool named "<malformed>": its error is the environment's answer."""

    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self, argument: str):
        self.argument = argument

    def parse(self, text: str) -> ToolCall | None:
        match = self._CALL.search(text)
        if match is None:
            return None
        try:
            body = json.loads(match.group(1))
            return ToolCall(str(body["name"]), str(body["arguments"][self.argument]))
        except (ValueError, KeyError, TypeError):
            return ToolCall("<malformed>", match.group(1).strip())

    def write(self, call: ToolCall) -> str:
        return ("<tool_call>\n" + json.dumps({"name": call.name, "arguments": {self.argument: call.arguments}})
                + "\n</tool_call>")


@dataclass
class ToolEnvironment:
    """A turn that calls a known tool is answered with the tool's result (its `ToolResult` text); a turn that calls
    an unknown tool is answered with an error naming the known ones; any other turn is the policy's answer and
    ends the conversation. `tools`: name -> the callable; `timeout_s`: each call's limit (rlmm/tasks/tools.py)."""

    tools: dict
    calls: object  # a CallFormat: TerseCalls or HermesCalls
    timeout_s: float
    counts: dict = field(default_factory=dict)

    def reply(self, messages: list[dict]) -> Reply:
        call = self.calls.parse(messages[-1]["content"])
        if call is None:
            return Reply(None)
        if call.name not in self.tools:
            result = ToolResult(f"error: unknown tool {call.name!r} (known: {', '.join(sorted(self.tools))})",
                                "error")
        else:
            result = run_tool(self.tools[call.name], call.arguments, self.timeout_s)
        return Reply({"role": "tool", "content": result.text}, tool=result)


def check_known_tools(names: list[str], known: dict, where: str) -> None:
    """One line for a tool the environment does not know (before any engine starts)."""
    for name in names:
        if name not in known:
            raise ValueError(f"{where}: unknown tool {name!r} (allowed: {', '.join(sorted(known))})")
