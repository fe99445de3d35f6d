"""A math agent written against the OpenAI chat API, trained by arl (`recipes/gsm8k_agent.py`).

``run`` answers the row's prompt in one turn; ``run_with_calculator`` offers a calculator tool
and loops (answer -> tool calls -> results -> answer) for at most ``MAX_TURNS`` turns. Both
return the final answer text, which the run's reward function (``rollout.reward``) scores.
Nothing here is arl-specific beyond the signature: ``client`` could be ``openai.AsyncOpenAI``.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from arl.agent import PromptTooLong

MAX_TURNS = 4

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as (12 + 30) * 4 / 2.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression"}},
            "required": ["expression"],
        },
    },
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses), as text;
    anything else gives an ``error: ...`` text the model can read."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        value = ev(ast.parse(expression.replace(",", ""), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def call_tool(name: str, arguments: str) -> str:
    """Run one tool call of the model (only the calculator exists)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is calculator"
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        return 'error: arguments must be a JSON object like {"expression": "2 + 2"}'
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return 'error: arguments must be a JSON object like {"expression": "2 + 2"}'
    return calculate(args["expression"])


async def run(client: Any, data: dict) -> str:
    """One answer to the row's chat prompt."""
    response = await client.chat.completions.create(messages=data["messages"])
    return response.choices[0].message.content or ""


async def run_with_calculator(client: Any, data: dict) -> str:
    """Answer with a calculator at hand: tool calls are run and their results sent back."""
    messages: list[Any] = list(data["messages"])
    answer = ""
    for _ in range(MAX_TURNS):
        try:
            response = await client.chat.completions.create(messages=messages, tools=[CALCULATOR])
        except PromptTooLong:  # the conversation outgrew the context budget: stop here
            if len(messages) == len(data["messages"]):
                raise  # not even the question fits: data.max_prompt_len is too small
            break
        message = response.choices[0].message
        messages.append(message)
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer
