"""GSM8K with a tool (a calculator or a Python interpreter), multi-turn, for `model=hf` instruct checkpoints whose
chat template takes `tools` (Qwen2.5, Qwen3 and most Hermes-style function-calling models)."""
from __future__ import annotations

from rlmm.tasks.base import Example
from rlmm.tasks.environment import HermesCalls, Reply, ToolEnvironment, check_known_tools
from rlmm.tasks.gsm8k import Gsm8kTask
from rlmm.tasks.tools import PythonTool, calculator

TOOL_SCHEMAS = {
    "calculator": ("expression", "Evaluate an arithmetic expression (numbers, + - * / // % and parentheses) and return "
                                 "its value."),
    "python": ("code", "Run Python code in a fresh interpreter and return what it prints."),
}


def tool_schema(name: str) -> dict:
    """The OpenAI-style function schema the chat template lists the tool with."""
    argument, description = TOOL_SCHEMAS[name]
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {argument: {"type": "string"}}, "required": [argument]}}}


class Gsm8kToolsTask:
    """GSM8K word problems (rlmm/tasks/gsm8k.py: the same data, splits and reward) answered in a conversation with one
    tool the policy may call in Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`); the
    chat template lists it (`tools`). The system prompt says how to answer; the reward is GSM8K's on the last
    assistant message (the number after ``####``, else its last number).

    Args:
        path, seed: as `Gsm8kTask`.
        tool: calculator (rlmm/tasks/tools.py's ast calculator, argument "expression") or python (the code run by a
            fresh interpreter in a subprocess killed at the limit, argument "code": run it in a sandbox).
        system_prompt: the conversation's first message.
        max_turns, max_context_tokens: the environment's limits (rlmm/tasks/environment.py).
        tool_timeout_s: each tool call's limit; a call past it answers "error: timed out".
    """

    # the environment's limits: they change no demonstration, so they do not name a warm-started model
    environment_keys = ("max_turns", "max_context_tokens", "tool_timeout_s")

    def __init__(self, path: str, seed: int, tool: str, system_prompt: str, max_turns: int, max_context_tokens: int,
                 tool_timeout_s: float):
        check_known_tools([tool], TOOL_SCHEMAS, "task.tool")
        for key, value in (("max_turns", max_turns), ("max_context_tokens", max_context_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"task.{key}: must be an integer >= 1, got {value!r}")
        if not (isinstance(tool_timeout_s, (int, float)) and tool_timeout_s > 0):
            raise ValueError(f"task.tool_timeout_s: must be > 0, got {tool_timeout_s!r}")
        self.problems = Gsm8kTask(path=path, seed=seed, prompt_template="{question}")
        self.system_prompt, self.max_turns, self.max_context_tokens = system_prompt, max_turns, max_context_tokens
        implementation = calculator if tool == "calculator" else PythonTool(timeout_s=float(tool_timeout_s))
        self.environment = ToolEnvironment({tool: implementation}, HermesCalls(argument=TOOL_SCHEMAS[tool][0]),
                                           float(tool_timeout_s) + 1.0)  # the python tool kills its own work first
        self.tools = [tool_schema(tool)]

    def examples(self, split: str, n: int) -> list[Example]:
        return self.problems.examples(split, n)

    def reward(self, example: Example, completion: str) -> float:
        return self.problems.reward(example, completion)

    def first_messages(self, example: Example) -> list[dict]:
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": example.prompt}]

    def reply(self, example: Example, messages: list[dict]) -> Reply:
        return self.environment.reply(messages)

    def demonstration(self, example: Example) -> list[dict]:
        """The reference solution as one answer (GSM8K holds no tool calls)."""
        return self.first_messages(example) + [{"role": "assistant", "content": self.problems.target(example)}]
