"""Tool calls in OpenAI's shape, through the model's own chat template.

The template renders the tools (Qwen2.5's and Llama 3.x's take a `tools` list), and the model answers a call in its
own words: Qwen2.5 (Hermes style) `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3.x a bare
`{"name": ..., "parameters": {...}}`. parse_tool_calls reads either into OpenAI's `tool_calls`; anything else, a
malformed call included, stays the answer's text. tool_choice "required" or a named function is held to a call by
constrained decoding (call_grammar: a grammar in the model's format, constrain.Constraint).
"""
from __future__ import annotations

import json
import re
import uuid

from storage.errors import UserError

from .constrain import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


class ToolError(UserError, ValueError):
    """A request's tools, tool_choice or tool messages are malformed: `param` names the field (a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a non-empty list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}, names unique."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("'tools' must be a non-empty list", "tools")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        name = f.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name in names:
            raise ToolError(f"tools[{i}].function.name must be a unique name of 1-64 letters, digits, _ . or -",
                            f"tools[{i}].function.name")
        if not isinstance(f.get("parameters", {}), dict) or not isinstance(f.get("description", ""), str):
            raise ToolError(f"tools[{i}].function: 'parameters' must be a JSON schema object, 'description' a string",
                            f"tools[{i}].function")
        names.add(name)
    return tools


def check_tool_choice(choice, tools: list[dict] | None) -> str:
    """"auto" (the default with tools), "none", "required", or the name of the one function to call."""
    if choice is None:
        return "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools or []]
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ToolError("tool_choice 'required' needs 'tools'", "tool_choice")
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if not isinstance(name, str):
        raise ToolError("'tool_choice' must be 'auto', 'none', 'required' or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise ToolError(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    return name


def template_message(m: dict, where: str) -> dict:
    """An assistant message's `tool_calls` and a tool message's `tool_call_id` as templates take them: the calls'
    arguments as objects (OpenAI sends them as JSON text; Qwen's and Llama's templates write them with tojson)."""
    out = {}
    if m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise ToolError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        out["tool_calls"] = []
        for k, c in enumerate(calls):
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise ToolError(f"{where}.tool_calls[{k}] must have a function with a name", f"{where}.tool_calls")
            args = f.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ToolError(f"{where}.tool_calls[{k}].function.arguments is not valid JSON",
                                    f"{where}.tool_calls") from None
            out["tool_calls"].append({"id": c.get("id"), "type": "function",
                                      "function": {"name": f["name"], "arguments": args}})
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out


def call_format(template: str) -> str:
    """"hermes" (<tool_call> tags: Qwen2.5) when the template speaks of them, else "json" (Llama 3.x)."""
    return "hermes" if OPEN in template else "json"


def call_grammar(tokenizer, tools: list[dict], name: str | None) -> str:
    """A Lark grammar (llguidance's) of one call, in the template's format, of the function `name` or any of them."""
    hermes = call_format(tokenizer.chat_template) == "hermes"
    key = "arguments" if hermes else "parameters"
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False}
               for f in (t["function"] for t in tools) if name is None or f["name"] == name]
    call = {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": JSON_OPTIONS}
    lark = f"call: %json {json.dumps(call)}\n"
    if not hermes:
        return "start: call\n" + lark

    def tag(text):     # Qwen's tags are tokens of their own: the grammar asks for those, not the text spelt out
        tid = tokenizer.tok.token_to_id(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)
    return f'start: {tag(OPEN)} "\\n" call "\\n" {tag(CLOSE)}\n' + lark


def _calls(obj, names: set[str]) -> list[dict] | None:
    """The calls a parsed JSON value holds: an object (or a list of them) with a known "name" and object
    "arguments" or "parameters"; None when it is anything else."""
    found = []
    for c in obj if isinstance(obj, list) and obj else [obj]:
        args = c.get("arguments", c.get("parameters")) if isinstance(c, dict) else None
        if not isinstance(args, dict) or c.get("name") not in names:
            return None
        found.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": c["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return found


def parse_tool_calls(text: str, names) -> tuple[str, list[dict]]:
    """(content, tool_calls) of a model's answer: <tool_call> blocks taken out of the text, or the whole answer (in a
    ```json fence or not) a call of one of `names`. A block that does not parse, an unclosed one or an unknown name
    leaves the whole answer as text, with no calls."""
    names = set(names)
    if OPEN in text:
        calls = []
        for block in _BLOCK.findall(text):
            try:
                found = _calls(json.loads(block), names)
            except ValueError:
                found = None
            if found is None:
                return text, []
            calls += found
        rest = _BLOCK.sub("", text)
        return (rest.strip(), calls) if calls and OPEN not in rest else (text, [])
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1) if fenced else body
    if body and body[0] in "{[":
        try:
            found = _calls(json.loads(body), names)
        except ValueError:
            found = None
        if found:
            return "", found
    return text, []


class ToolText:
    """A streamed answer's text with its tool calls held back: push() returns the text safe to show as content (up to
    a <tool_call>, or nothing when the answer opens as JSON, which may be a whole call); finish() parses what was held:
    (the text still to show, the calls). One path for whole and streamed answers."""

    def __init__(self, names):
        self.names = list(names)
        self.shown, self.held, self.holding = "", "", False

    def push(self, piece: str) -> str:
        text = self.held + piece
        if self.holding:
            self.held = text
            return ""
        if not self.shown.strip() and text.lstrip()[:1] in ("{", "[", "`"):
            self.holding, self.held = True, text
            return ""
        i = text.find(OPEN)
        if i >= 0:
            self.holding, self.held, out = True, text[i:], text[:i]
        else:   # a tail that may begin the tag waits for the next piece
            keep = next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:k])), 0)
            self.held, out = text[len(text) - keep:], text[:len(text) - keep]
        self.shown += out
        return out

    def finish(self) -> tuple[str, list[dict]]:
        rest, calls = parse_tool_calls(self.held, self.names)
        return (rest.strip(), calls) if calls else (self.held, [])
