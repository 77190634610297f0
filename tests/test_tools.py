"""rlmm/tasks/tools.py and rlmm/tasks/environment.py: tools that fail become that turn's answer, never a crash;
tool calls parsed in both formats; the calculator task's problems, demonstrations, environment and reward."""
import time
from pathlib import Path

import pytest

from rlmm.tasks.calculator import CalculatorTask
from rlmm.tasks.environment import HermesCalls, TerseCalls, ToolCall, ToolEnvironment, is_multi_turn
from rlmm.tasks.tools import MAX_TOOL_CHARS, PythonTool, calculator, run_tool

CALCULATOR = dict(seed=0, min_value=0, max_value=99, operations=["+", "-", "*"], operands=3, direct_demos=0.0,
                  max_turns=4, max_context_tokens=96, tool_timeout_s=1.0)


def calculator_task(**values) -> CalculatorTask:
    return CalculatorTask(**(CALCULATOR | values))


def test_calculator_computes_and_refuses():
    assert calculator("37*48") == "1776"
    assert calculator(" (1776 + 12) ") == "1788"
    assert calculator("-47*20") == "-940"
    assert calculator("7/2") == "3.5" and calculator("1/3") == "0.333333"
    for bad, message in (("__import__('os')", "not allowed"), ("2**10", "not allowed"), ("1e13*10", "beyond"),
                         ("37*", "not an arithmetic")):
        with pytest.raises(ValueError, match=message):
            calculator(bad)
    with pytest.raises(ZeroDivisionError):
        calculator("1/0")


def test_a_tool_that_raises_hangs_or_returns_garbage_is_an_answer():
    assert run_tool(calculator, "2+2", 1.0).text == "4" and run_tool(calculator, "2+2", 1.0).status == "ok"
    raised = run_tool(calculator, "1/0", 1.0)
    assert raised.status == "error" and raised.text.startswith("error: ZeroDivisionError")
    started = time.perf_counter()
    hung = run_tool(lambda _: time.sleep(30), "", 0.2)
    assert hung.status == "timeout" and hung.text == "error: timed out after 0.2 s"
    assert time.perf_counter() - started < 2
    assert run_tool(lambda _: b"\x00\xff", "", 1.0).status == "garbage"
    long = run_tool(lambda _: "9" * 1000, "", 1.0)
    assert long.status == "garbage" and len(long.text) == MAX_TOOL_CHARS
    unprintable = run_tool(lambda _: "ok\x07", "", 1.0)
    assert unprintable.status == "garbage" and "\\x07" in unprintable.text
    assert run_tool(lambda _: "two\nlines", "", 1.0).status == "ok"


def test_the_python_tool_runs_code_in_a_killed_subprocess():
    tool = PythonTool(timeout_s=5.0)
    assert run_tool(tool, "print(6*7)", 10.0).text == "42"
    failed = run_tool(tool, "1/0", 10.0)
    assert failed.status == "error" and "ZeroDivisionError: division by zero" in failed.text
    started = time.perf_counter()
    slow = run_tool(PythonTool(timeout_s=0.5), "while True: pass", 10.0)
    assert slow.status == "error" and "ran past 0.5 s" in slow.text and time.perf_counter() - started < 5


def test_call_formats_parse_and_write():
    terse = TerseCalls()
    assert terse.parse("calc(37*48)") == ToolCall("calc", "37*48") and terse.parse(" 1776 ") is None
    assert terse.write(ToolCall("calc", "1+2")) == "calc(1+2)"
    hermes = HermesCalls(argument="expression")
    text = "Let me compute.\n" + hermes.write(ToolCall("calculator", "37*48"))
    assert hermes.parse(text) == ToolCall("calculator", "37*48")
    assert hermes.parse("The answer is 4.") is None
    assert hermes.parse("<tool_call>{not json}</tool_call>") == ToolCall("<malformed>", "{not json}")


def test_the_environment_answers_calls_and_ends_on_an_answer():
    environment = ToolEnvironment({"calc": calculator}, TerseCalls(), timeout_s=1.0)
    reply = environment.reply([{"role": "assistant", "content": "calc(2*3)"}])
    assert reply.message == {"role": "tool", "content": "6"} and not reply.done and reply.tool.status == "ok"
    unknown = environment.reply([{"role": "assistant", "content": "sqrt(4)"}])
    assert unknown.message["content"] == "error: unknown tool 'sqrt' (known: calc)" and unknown.tool.status == "error"
    assert environment.reply([{"role": "assistant", "content": "6"}]).done


def test_calculator_task_problems_demonstrations_and_reward():
    task = calculator_task()
    assert is_multi_turn(task)
    examples = task.examples("train", 50)
    assert examples == calculator_task().examples("train", 50)
    assert not {e.prompt for e in examples} & {e.prompt for e in task.examples("test", 200)}
    example = next(e for e in examples if e.prompt.startswith("(") and "*" in e.prompt)
    demo = task.demonstration(example)
    assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    # Each call is answered by the environment with what the demonstration says it returns.
    for i in (1, 3):
        assert task.reply(example, demo[:i + 1]).message == demo[i + 1]
    assert task.reply(example, demo).done and demo[-1]["content"] == example.answer
    assert task.reward(example, example.answer) == 1.0 and task.reward(example, example.answer + "1") == 0.0
    direct = calculator_task(direct_demos=1.0).demonstration(example)
    assert [m["role"] for m in direct] == ["user", "assistant"] and direct[1]["content"] == example.answer


@pytest.mark.parametrize("key, value, message", [
    ("max_turns", 0, "task.max_turns: must be an integer >= 1, got 0"),
    ("operands", 4, "task.operands: 4 (allowed: 2, 3)"),
    ("operations", ["/"], "task.operations"),
    ("direct_demos", 1.5, "task.direct_demos"),
    ("max_context_tokens", 0, "task.max_context_tokens"),
    ("tool_timeout_s", 0, "task.tool_timeout_s")])
def test_calculator_task_refuses_bad_values(key, value, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        calculator_task(**{key: value})


def test_gsm8k_with_a_tool_answers_hermes_calls_and_scores_the_last_message():
    from rlmm.tasks.gsm8k_tools import Gsm8kToolsTask

    values = dict(path=str(Path(__file__).parent / "data" / "gsm8k_sample.jsonl"), seed=0, system_prompt="Solve.",
                  max_turns=3, max_context_tokens=1024, tool_timeout_s=5.0)
    task = Gsm8kToolsTask(tool="calculator", **values)
    example = task.examples("train", 1)[0]
    messages = task.first_messages(example)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == example.prompt
    assert task.tools[0]["function"]["name"] == "calculator"
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48/2"}}\n</tool_call>'
    assert task.reply(example, messages + [{"role": "assistant", "content": call}]).message["content"] == "24"
    assert task.reply(example, messages + [{"role": "assistant", "content": "#### 72"}]).done
    assert task.reward(example, f"so\n#### {example.answer}") == 1.0
    python = Gsm8kToolsTask(tool="python", **values)
    code = '<tool_call>{"name": "python", "arguments": {"code": "print(48 // 2)"}}</tool_call>'
    assert python.reply(example, messages + [{"role": "assistant", "content": code}]).message["content"] == "24"
    with pytest.raises(ValueError, match=r"^task.tool: unknown tool 'sql' \(allowed: calculator, python\)$"):
        Gsm8kToolsTask(tool="sql", **values)
