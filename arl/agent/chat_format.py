"""The model's own chat format: messages and tools in through its chat template, tool calls out.

Messages are OpenAI-shaped (``role``, ``content``, ``tool_calls``, ``tool_call_id``), as dicts or
as the message objects `arl.agent.client` returns. The tokenizer's chat template renders them.
A template that does not render ``tools`` itself (SmolLM2's plain ChatML, for one) gets the tool
definitions in the system message in the Hermes format SmolLM2 and Qwen models were tuned on,
and a template that does not render an assistant's ``tool_calls`` gets them back in the
content as the ``<tool_call>{json}</tool_call>`` blocks the model wrote. Tool calls are parsed
from the generated text in that same format (a JSON object, or a list of them, per block).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs

ROLES = ("system", "user", "assistant", "tool")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SENTINEL = "\x00arl-sentinel\x00"

TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, in this format:\n"
    '<tool_call>{{"name": <function-name>, "arguments": <arguments-json-object>}}</tool_call>\n'
    "Each function's answer comes back to you in a message from the tool."
)


class MessageError(ValueError):
    """A chat message (or tool definition) the client cannot use; the message says which."""


class PromptTooLong(ValueError):
    """A prompt longer than ``max_prompt_len`` (``data.max_prompt_len``) that may not be cut."""


@attrs.define
class Function:
    """The function of a tool call: its name and its arguments as a JSON string."""

    name: str
    arguments: str


@attrs.define
class ToolCall:
    """One tool call of an assistant message (OpenAI shape)."""

    id: str
    function: Function
    type: str = "function"

    def to_dict(self) -> dict:
        """The OpenAI JSON shape."""
        return attrs.asdict(self)

    model_dump = to_dict


def _content_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts are understood
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and "text" in p):
                raise MessageError(f"{where}: only text content parts are supported, got {p!r}")
            parts.append(str(p["text"]))
        return "".join(parts)
    raise MessageError(f"{where}: content must be a string, a list of text parts or None")


def _arguments(args: Any) -> Any:
    """Arguments as a JSON value when they parse (so equal calls compare equal), else the text."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def normalize_message(message: Any, where: str = "message") -> dict:
    """A plain dict of ``message`` (a dict or a message object), checked; ``tool_calls`` as
    ``[{"id", "name", "arguments"}]`` with arguments parsed from JSON when they parse."""
    if hasattr(message, "to_dict"):
        message = message.to_dict()
    elif hasattr(message, "model_dump"):  # an openai / pydantic object
        message = message.model_dump()
    if not isinstance(message, dict):
        raise MessageError(f"{where} must be a dict or a message object, got {type(message)}")
    role = message.get("role")
    if role not in ROLES:
        raise MessageError(f"{where}: role {role!r} is not one of {ROLES}")
    out: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), where)}
    calls = message.get("tool_calls") or []
    if calls:
        if role != "assistant":
            raise MessageError(f"{where}: only assistant messages carry tool_calls")
        norm = []
        for c in calls:
            c = c.to_dict() if hasattr(c, "to_dict") else c
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise MessageError(f"{where}: a tool call needs function.name, got {c!r}")
            norm.append(
                {
                    "id": c.get("id"),
                    "name": fn["name"],
                    "arguments": _arguments(fn.get("arguments")),
                }
            )
        out["tool_calls"] = norm
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def same_turn(a: dict, b: dict) -> bool:
    """Whether two normalized messages say the same (tool-call ids and blank content aside)."""

    def key(m: dict) -> tuple:
        calls = [
            (c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in m.get("tool_calls", [])
        ]
        return m["role"], (m["content"] or "").strip(), calls, m.get("tool_call_id")

    return key(a) == key(b)


def check_tools(tools: Any) -> list[dict] | None:
    """OpenAI tool definitions ``[{"type": "function", "function": {"name", ...}}]``, checked."""
    if tools is None:
        return None
    if not isinstance(tools, list | tuple):
        raise MessageError(f"tools must be a list of tool definitions, got {type(tools)}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise MessageError(
                f"tools[{i}] must look like {{'type': 'function', 'function': {{'name': ..., "
                f"'description': ..., 'parameters': {{...}}}}}}, got {t!r}"
            )
    return [dict(t) for t in tools]


def tool_call_block(name: str, arguments: Any) -> str:
    """One call in the model's format (how an assistant's tool_calls are written back)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def new_call_id() -> str:
    """A fresh OpenAI-style tool-call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatFormat:
    """Renders messages with the tokenizer's chat template and parses tool calls from text."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise MessageError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no chat "
                "template; the agent client needs the model's own chat format"
            )
        self.tokenizer = tokenizer
        source = str(tokenizer.chat_template)
        # Whether the template itself renders tool definitions and an assistant's tool calls.
        self.native_tools = "tools" in source
        self.native_tool_calls = "tool_calls" in source
        self.eos_ids = (
            {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        )
        self.turn_end = self._turn_end()

    # ---- rendering --------------------------------------------------------------------------
    def render(
        self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool
    ) -> str:
        """The template's text of normalized ``messages`` (and ``tools``)."""
        msgs = [self._template_message(m) for m in messages]
        kwargs: dict[str, Any] = {}
        if tools:
            if self.native_tools:
                kwargs["tools"] = tools
            else:
                msgs = self._with_tools_prompt(msgs, tools)
        text = self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (the template writes any special tokens itself)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        """Text of token ids; special tokens kept only with ``special``."""
        return self.tokenizer.decode(ids, skip_special_tokens=not special)

    def _template_message(self, m: dict) -> dict:
        out = {"role": m["role"], "content": m["content"] or ""}
        calls = m.get("tool_calls")
        if calls:
            if self.native_tool_calls:
                out["tool_calls"] = [
                    {
                        "id": c["id"] or new_call_id(),
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in calls
                ]
            else:
                blocks = "".join(tool_call_block(c["name"], c["arguments"]) for c in calls)
                out["content"] = (out["content"] + "\n" if out["content"] else "") + blocks
        for key in ("tool_call_id", "name"):
            if key in m:
                out[key] = m[key]
        return out

    @staticmethod
    def _with_tools_prompt(msgs: list[dict], tools: list[dict]) -> list[dict]:
        listed = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        prompt = TOOLS_PROMPT.format(tools=listed)
        if msgs and msgs[0]["role"] == "system":
            first = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{prompt}"}
            return [first, *msgs[1:]]
        return [{"role": "system", "content": prompt}, *msgs]

    def _turn_end(self) -> str:
        """The text the template writes after an assistant message's content (ChatML:
        ``<|im_end|>\\n``), found by rendering a sentinel."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render([normalize_message(m) for m in probe], None, add_generation_prompt=False)
        if _SENTINEL not in text:
            return ""
        return text.split(_SENTINEL, 1)[1]

    def closing(self, output_ids: list[int]) -> str:
        """What follows a generated turn before the next message: the template's turn end,
        less the end-of-turn token when the generation stopped on it."""
        end = self.turn_end
        if output_ids and output_ids[-1] in self.eos_ids:
            eos = self.decode(output_ids[-1:], special=True)
            if end.startswith(eos):
                return end[len(eos) :]
        return end

    # ---- parsing ----------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of generated text; content keeps what is outside the calls.

        A block that is not valid JSON naming a function leaves the whole text as content and
        no calls (as an OpenAI-compatible server does with an unparsable call).
        """
        blocks = _TOOL_CALL.findall(text)
        if not blocks:
            return text, []
        calls: list[ToolCall] = []
        for body in blocks:
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            for item in value if isinstance(value, list) else [value]:
                if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                    return text, []
                args = item.get("arguments", {})
                args = args if isinstance(args, str) else json.dumps(args)
                calls.append(ToolCall(new_call_id(), Function(item["name"], args)))
        content = _TOOL_CALL.sub("", text).strip()
        return content or None, calls
