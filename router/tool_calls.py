"""Tool calls for the OpenAI chat API.

Three ways a call comes out of a request that carries `tools`:

- `tool_choice: required`: the output is constrained (structured outputs) to
  a JSON array of one or more `{"name": ..., "parameters": {...}}` objects,
  each naming a declared function and holding arguments valid against its
  schema; so the calls always parse.
- `tool_choice: {"type": "function", "function": {"name": N}}`: the output is
  constrained to N's parameters schema; the whole output is the arguments.
- `tool_choice: auto` (the default with tools): the model writes what its chat
  template taught it; a parser finds the calls in that text. Formats:
  `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` per
  call: Hermes, Qwen 2.5 / 3, SmolLM3 and other templates that mention
  `<tool_call>`) and `llama3_json` (the output is one JSON object
  `{"name": ..., "parameters": {...}}`, or several separated by `;`, as the
  Llama 3.1-3.3 templates ask). `detect` reads the format off the template;
  `server.tool_call_parser` overrides it. A call is kept only when it parses
  and names a declared function; otherwise the text stays content.

Streaming: `AutoStream` passes content through as it comes and holds back
only what may be the start of a call, then buffers the call until the
output ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

_HERMES_START, _HERMES_END = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


class ToolError(ValueError):
    """A tools list or tool_choice that cannot be served: the message names
    the field."""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def declared(tools: list) -> dict[str, dict]:
    """Function name -> parameters schema of OpenAI `tools`."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}]: a {{'type': 'function', 'function': {{...}}}} object")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ToolError(f"tools[{i}].function.name: 1-64 letters, digits, '_', '.' or '-'")
        if name in out:
            raise ToolError(f"tools[{i}].function.name: {name!r} is declared twice")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters: a JSON Schema object")
        out[name] = params or {"type": "object"}
    return out


def required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """The JSON Schema that `tool_choice: required` constrains the output to."""
    call = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, params in functions.items()
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_required(text: str) -> list[ToolCall]:
    """The calls of a `required` output; [] when it does not parse (the
    output was cut by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        calls.append(ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


def call_from_named(name: str, text: str) -> list[ToolCall]:
    try:
        args = json.loads(text)
    except ValueError:
        return []
    return [ToolCall(name, text.strip())] if isinstance(args, dict) else []


def detect(chat_template: str | None) -> str:
    """The auto-call format a chat template teaches its model ('none' when
    it shows no tool calls)."""
    t = chat_template or ""
    if _HERMES_START in t:
        return "hermes"
    if _PYTHON_TAG in t or ('"parameters"' in t and "tools" in t):
        return "llama3_json"
    return "none"


def _call(obj, functions: dict[str, dict], args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse(fmt: str, text: str, functions: dict[str, dict]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole auto output. With no valid call the whole
    text is the content; with calls the content is the text before them."""
    if fmt == "hermes":
        at = text.find(_HERMES_START)
        if at < 0:
            return text, []
        calls = []
        for chunk in text[at:].split(_HERMES_START)[1:]:
            body = chunk.split(_HERMES_END, 1)[0].strip()
            try:
                call = _call(json.loads(body), functions, "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:at].rstrip(), calls
    if fmt == "llama3_json":
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, functions, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return "", calls
    return text, []


class AutoStream:
    """Per-choice state of a streamed auto output: `feed` returns the content
    that can go out now; `finish` returns the rest of the content and the
    calls."""

    def __init__(self, fmt: str, functions: dict[str, dict]) -> None:
        self.fmt, self.functions = fmt, functions
        self.held = ""
        self.in_call = False
        self.sent = False  # content has gone out (llama3_json calls only open an output)

    def feed(self, text: str) -> str:
        if self.in_call:
            self.held += text
            return ""
        buf = self.held + text
        start = self._start(buf)
        if start is not None:
            self.in_call = True
            out, self.held = buf[:start], buf[start:]
        else:
            keep = self._partial(buf)
            out, self.held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.sent = self.sent or bool(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        if not self.in_call:
            return self.held, []
        content, calls = parse(self.fmt, self.held, self.functions)
        return (content, calls) if calls else (self.held, [])

    def _start(self, buf: str) -> int | None:
        if self.fmt == "hermes":
            at = buf.find(_HERMES_START)
            return at if at >= 0 else None
        if self.fmt == "llama3_json" and not self.sent:
            body = buf.lstrip()
            if body.startswith(("{", _PYTHON_TAG)):
                return 0
        return None

    def _partial(self, buf: str) -> int:
        """How many trailing characters may still become a call's start."""
        if self.fmt == "hermes":
            for n in range(min(len(_HERMES_START) - 1, len(buf)), 0, -1):
                if _HERMES_START.startswith(buf[-n:]):
                    return n
            return 0
        if self.fmt == "llama3_json" and not self.sent:
            body = buf.lstrip()
            if not body or _PYTHON_TAG.startswith(body):
                return len(buf)
        return 0
