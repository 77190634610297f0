"""Tools an environment runs for the policy (rlmm/tasks/environment.py), and the one place a tool's call is made
safe: whatever a tool does (raise, hang, return something that is not text, or text too long to fit a context),
`run_tool` returns a `ToolResult` whose text becomes that turn's answer, and says what went wrong, so a bad tool
is a recorded turn, never a crashed run.

- `calculator(expression)`: integer and fraction arithmetic (+ - * / // % and parentheses, unary minus) parsed with
  `ast`, never `eval`: a name, a call or an attribute is an error, and so is a number beyond `CALCULATOR_LIMIT`
  (no exponentiation: a huge power is the one way plain arithmetic hangs).
- `python(code)`: the code run by a fresh `python -I` (isolated: no user site, no PYTHON* variables) in a
  subprocess with a wall-clock limit, killed when it runs past it; its stdout (and the last line of stderr on an
  error) is the answer. It is as safe as running the policy's code on this machine is: use it in a sandbox.
"""
from __future__ import annotations

import ast
import operator
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

CALCULATOR_LIMIT = 10**12  # |value| beyond it is an error: far past any task's numbers, and bounded work
MAX_TOOL_CHARS = 200  # a tool's answer is cut to this many characters (a runaway print would fill the context)
TOOL_STATUSES = ("ok", "error", "timeout", "garbage")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


@dataclass(frozen=True)
class ToolResult:
    """What a tool call gave: the text the environment answers with, and how the call went (`TOOL_STATUSES`:
    ok; error: the tool raised, its message is the text; timeout: it ran past its limit; garbage: it returned
    something that is not text, or text cut to `MAX_TOOL_CHARS`)."""

    text: str
    status: str


def run_tool(tool: Callable[[str], object], arguments: str, timeout_s: float) -> ToolResult:
    """`tool(arguments)` in a daemon thread, waited for at most `timeout_s` seconds (a tool that hangs is left
    behind in its thread: a tool that may hang for good, such as `python`, kills its own work at its limit)."""
    outcome: dict[str, object] = {}

    def call():
        try:
            outcome["value"] = tool(arguments)
        except BaseException as err:  # noqa: BLE001 - any failure of the tool is its answer
            outcome["error"] = err

    worker = threading.Thread(target=call, daemon=True, name="rlmm-tool")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return ToolResult(f"error: timed out after {timeout_s:g} s", "timeout")
    if "error" in outcome:
        err = outcome["error"]
        return ToolResult(clip(f"error: {type(err).__name__}: {err}"), "error")
    value = outcome.get("value")
    if not isinstance(value, str):
        return ToolResult(clip(f"error: the tool returned {type(value).__name__}, not text"), "garbage")
    shown = printable(value)
    if len(value) > MAX_TOOL_CHARS or shown != value:
        return ToolResult(clip(shown), "garbage")
    return ToolResult(value, "ok")


def printable(text: str) -> str:
    """`text` with every character that is neither printable nor a newline written as its escape ("\\x07")."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def clip(text: str) -> str:
    return text if len(text) <= MAX_TOOL_CHARS else text[:MAX_TOOL_CHARS - 3] + "..."


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: an integer as digits ("1776"), a fraction that is not one as a
    decimal rounded to 6 places ("0.333333"). Raises ValueError on anything else, ZeroDivisionError on / 0."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0")


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(node.value)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        value = Fraction(_BINARY[type(node.op)](left, right))
    else:
        raise ValueError(f"not allowed in a calculation: {ast.unparse(node)!r} (numbers, + - * / // % and "
                         f"parentheses only)")
    if abs(value) > CALCULATOR_LIMIT:
        raise ValueError(f"a number beyond {CALCULATOR_LIMIT:.0e}")
    return value


class PythonTool:
    """`python(code)`: the code's stdout, run by `python -I -c code` in a subprocess killed after `timeout_s`
    (raises on a timeout; the last line of stderr as a RuntimeError when the code fails)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __call__(self, code: str) -> str:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True,
                                  timeout=self.timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the code ran past {self.timeout_s:g} s and was killed") from None
        if done.returncode:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise RuntimeError(last)
        return done.stdout.strip()
