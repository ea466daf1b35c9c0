"""Tool calling: what the model is told, what it may say, and how its text becomes tool calls.

No torch. A parser reads a choice's whole text so far (`parse(text, final)`) and says which
part is plain content and which tool calls it holds, each as far as it has been written; a
`ToolCallStream` diffs successive parses into OpenAI's streamed deltas, so the streamed
pieces always add up to what the non-streamed answer holds. A call's `arguments` is the JSON
text the model wrote for them, as written.

Formats:
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated (Hermes,
  Qwen2/2.5/3; also what servelm asks of a model whose template does not render tools); or,
  as small Qwen models often answer, the whole answer one bare call object or an array of
  them, in a ```json fence or not, each naming a tool of the request (`bare_calls`);
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}`, calls joined by `;`
  (Llama 3.1+, after `<|python_tag|>` or not);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` per call;
- forced: `tool_choice` "required" or a named function makes the output a grammar over the
  tools' schemas (`forced_schema`), read by `ArrayCallsParser` / `NamedCallParser`.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field

from servelm.server.reasoning import H_ENDS, H_MESSAGE

WS = " \t\r\n"


@dataclass
class PartialCall:
    """One tool call as far as the text has written it: the name once it is complete, the
    arguments' JSON text so far (None until its name is known), whether the call ended."""

    name: str | None = None
    arguments: str | None = None
    complete: bool = False


@dataclass
class Parsed:
    """A parse of the text so far: the content that is surely content, and the calls."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


# ---- a small partial-JSON scanner ------------------------------------------------------------


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """The end of the JSON value starting at s[i], or None if s stops inside it."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(s):
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: ends at a delimiter
    while j < len(s) and s[j] not in WS + ",}]":
        j += 1
    return j if j < len(s) else None


def walk_object(s: str, i: int, name_keys: tuple[str, ...], args_keys: tuple[str, ...]
                ) -> tuple[PartialCall, int | None]:
    """Read the call object starting at s[i] ('{'): its name and arguments as far as written,
    and the index past the object (None while it is open)."""
    call = PartialCall()
    end = value_end(s, i)
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s) or s[j] == "}":
            break
        if s[j] == ",":
            j += 1
            continue
        key_end = value_end(s, j)
        if s[j] != '"' or key_end is None:
            break
        try:
            key = json.loads(s[j:key_end])
        except ValueError:
            break
        j = skip_ws(s, key_end)
        if j >= len(s) or s[j] != ":":
            break
        j = skip_ws(s, j + 1)
        v_end = value_end(s, j)
        if key in name_keys and v_end is not None and s[j] == '"':
            try:
                call.name = json.loads(s[j:v_end])
            except ValueError:
                break
        elif key in args_keys and j < len(s) and s[j] in "{[":
            if call.name is not None or v_end is not None:
                call.arguments = s[j:v_end] if v_end is not None else s[j:]
        elif key in args_keys and v_end is not None and s[j] == '"':
            try:  # arguments given as a JSON-encoded string
                call.arguments = json.loads(s[j:v_end])
            except ValueError:
                break
        if v_end is None:
            break
        j = v_end
    if end is not None:
        call.complete = call.name is not None
        if call.arguments is None and call.complete:
            call.arguments = "{}"
    return call, end


def walk_array(s: str, i: int, args_keys: tuple[str, ...]) -> list[PartialCall]:
    """The call objects of the JSON array starting at s[i] ('['), as far as written."""
    calls, j = [], i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s) or s[j] != "{":
            return calls
        call, end = walk_object(s, j, ("name",), args_keys)
        calls.append(call)
        if end is None:
            return calls
        j = skip_ws(s, end)
        if j < len(s) and s[j] == ",":
            j += 1


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Where the surely-content part of `text` ends: trailing whitespace and a trailing
    prefix of a marker may yet turn out to open a tool call."""
    cut = len(text)
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                cut = min(cut, len(text) - k)
                break
    while cut > 0 and text[cut - 1] in WS:
        cut -= 1
    return cut


# ---- parsers ---------------------------------------------------------------------------------


class ToolParser:
    name = ""
    skip_special_tokens = True  # False where a call opens with a special token

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return new_call_id()

    def for_tools(self, names: list[str]) -> ToolParser:
        """The parser for one request offering the tools `names` (this one, unless the format
        reads calls only by the names it may name)."""
        return self


class HermesParser(ToolParser):
    """Calls in <tool_call> tags; with the request's tool names (`for_tools`), also a bare
    call object or array as the whole answer."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: frozenset[str] = frozenset()):
        self.tools = tools

    def for_tools(self, names: list[str]) -> HermesParser:
        return HermesParser(frozenset(names))

    def parse(self, text: str, final: bool) -> Parsed:
        if self.tools:
            state, calls = bare_calls(text, self.tools)
            if state == CALLS and final:
                return Parsed("", calls)
            if state != NOT_CALLS and not final:
                return Parsed("")  # held back: it may yet be (or is, if it ends here) a call
        start = text.find(self.OPEN)
        if start < 0:
            return Parsed(text if final else text[:_held_back(text, (self.OPEN,))])
        calls, i = [], start
        while True:
            i = skip_ws(text, i + len(self.OPEN))
            if i >= len(text):
                break
            if text[i] != "{":
                return _not_calls(text, final, start)
            call, end = walk_object(text, i, ("name",), ("arguments", "parameters"))
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if text.startswith(self.CLOSE, i):
                i = skip_ws(text, i + len(self.CLOSE))
            nxt = text.find(self.OPEN, i)
            if nxt < 0:
                break
            i = nxt
        return _checked(text, final, start, calls)


class Llama3JsonParser(ToolParser):
    """The whole answer is one or more call objects joined by ';' (else it is content)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        if i >= len(text) or (not final and self.TAG.startswith(text[i:])):
            return Parsed("" if not final else text)
        if text[i] != "{":
            return Parsed(text)
        calls, start = [], i
        while True:
            call, end = walk_object(text, i, ("name",), ("parameters", "arguments"))
            calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            if i >= len(text) or text[i] != "{":
                break
        return _checked(text, final, start, calls)


class MistralParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a control token
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def new_call_id(self) -> str:
        # Mistral's templates refuse a history whose call ids are not 9 letters or digits.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return Parsed(text if final else text[:_held_back(text, (self.OPEN,))])
        i = skip_ws(text, start + len(self.OPEN))
        calls: list[PartialCall] = []
        if i < len(text) and text[i] == "[":  # [{"name": ..., "arguments": ...}, ...]
            calls = walk_array(text, i, ("arguments", "parameters"))
        else:  # name[ARGS]{...}, each call after its own [TOOL_CALLS]
            while i < len(text):
                a = text.find(self.ARGS, i)
                if a < 0:
                    break
                call = PartialCall(name=text[i:a].strip())
                j = skip_ws(text, a + len(self.ARGS))
                end = value_end(text, j)
                call.arguments = text[j:end] if end is not None else text[j:]
                call.complete = end is not None
                calls.append(call)
                if end is None:
                    break
                nxt = text.find(self.OPEN, end)
                if nxt < 0:
                    break
                i = skip_ws(text, nxt + len(self.OPEN))
        return _checked(text, final, start, calls)


class ArrayCallsParser(ToolParser):
    """tool_choice "required": the answer is a JSON array of {"name", "parameters"}."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        j = skip_ws(text, 0)
        return Parsed("", walk_array(text, j, ("parameters",)) if text[j:j + 1] == "[" else [])


class NamedCallParser(ToolParser):
    """tool_choice naming a function: the answer is that function's arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [PartialCall(self.function, text.strip() if final else text.lstrip(),
                                       complete=final)])


# ---- bare calls: the whole answer a call object or an array of them --------------------------

CALLS, MAYBE, NOT_CALLS = "calls", "maybe", "not calls"
FENCE = "```"
CALL_KEYS = ("name", "arguments", "parameters")


def bare_calls(text: str, tools: frozenset[str]) -> tuple[str, list[PartialCall]]:
    """Whether `text` is, as a whole answer, one call object or an array of them (CALLS, with
    the calls), may still become one as it goes on (MAYBE), or cannot (NOT_CALLS). Whitespace
    and a ```json (or bare ```) fence may wrap it; each object has exactly a "name" among
    `tools` and "arguments" (or "parameters"): an object, or a string holding one. A verdict
    of NOT_CALLS stands for every longer text, so content released on it is never taken back.
    CALLS holds only where the answer ends: more text after the calls would make it content.
    """
    i = skip_ws(text, 0)
    rest = text[i:]
    fenced = rest.startswith(FENCE)
    if not fenced and FENCE.startswith(rest):
        return MAYBE, []  # nothing yet, or the fence's first backticks
    if fenced:
        i += len(FENCE)
        tag = text[i:i + 4]
        if tag == "json":
            i += 4
        elif "json".startswith(tag) and i + len(tag) == len(text):
            return MAYBE, []
        if i < len(text) and text[i] not in WS + "{[":
            return NOT_CALLS, []  # another language, or a longer tag
        i = skip_ws(text, i)
        if i >= len(text):
            return MAYBE, []
    if text[i] == "{":
        state, call, end = _bare_object(text, i, tools)
        calls = [call] if call else []
    elif text[i] == "[":
        state, calls, end = _bare_array(text, i, tools)
    else:
        return NOT_CALLS, []
    if state != CALLS:
        return state, []
    j = skip_ws(text, end)
    if fenced and text.startswith(FENCE, j):
        j = skip_ws(text, j + len(FENCE))
    elif fenced and FENCE.startswith(text[j:]):
        j = len(text)  # the closing fence partly written, or missing at the end
    return (CALLS, calls) if j == len(text) else (NOT_CALLS, [])


def _bare_array(s: str, i: int, tools: frozenset[str]
                ) -> tuple[str, list[PartialCall], int]:
    """The array of call objects at s[i] ('['): its state, calls and end (when CALLS)."""
    calls: list[PartialCall] = []
    j = i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            return MAYBE, [], 0
        if s[j] != "{":
            return NOT_CALLS, [], 0  # also an empty array: no call
        state, call, end = _bare_object(s, j, tools)
        if state != CALLS:
            return state, [], 0
        calls.append(call)
        j = skip_ws(s, end)
        if j >= len(s):
            return MAYBE, [], 0
        if s[j] == "]":
            return CALLS, calls, j + 1
        if s[j] != ",":
            return NOT_CALLS, [], 0
        j += 1


def _could_be(partial: str, words) -> bool:
    """Whether an unfinished JSON string's raw text may still spell one of `words`: its part
    before any escape begins one of them (what an escape spells is left to the whole string)."""
    head = partial.split("\\", 1)[0]
    return any(w.startswith(head) for w in words)


def _bare_object(s: str, i: int, tools: frozenset[str]
                 ) -> tuple[str, PartialCall | None, int]:
    """The call object at s[i] ('{'): its state, and the call and its end when CALLS."""
    call, seen, j = PartialCall(), set(), i + 1
    while True:
        j = skip_ws(s, j)
        if j >= len(s):
            return MAYBE, None, 0
        if s[j] == "}":
            if call.name is None or call.arguments is None:
                return NOT_CALLS, None, 0
            call.complete = True
            return CALLS, call, j + 1
        if seen:
            if s[j] != ",":
                return NOT_CALLS, None, 0
            j = skip_ws(s, j + 1)
            if j >= len(s):
                return MAYBE, None, 0
        if s[j] != '"':
            return NOT_CALLS, None, 0
        key_end = value_end(s, j)
        if key_end is None:
            return (MAYBE if _could_be(s[j + 1:], CALL_KEYS) else NOT_CALLS), None, 0
        key = _loads(s[j:key_end])
        role = "name" if key == "name" else "arguments"
        if key not in CALL_KEYS or role in seen:
            return NOT_CALLS, None, 0
        seen.add(role)
        j = skip_ws(s, key_end)
        if j < len(s) and s[j] != ":":
            return NOT_CALLS, None, 0
        j = skip_ws(s, j + 1)
        if j >= len(s):
            return MAYBE, None, 0
        end = value_end(s, j)
        if role == "name":
            if s[j] != '"':
                return NOT_CALLS, None, 0
            if end is None:
                return (MAYBE if _could_be(s[j + 1:], tools) else NOT_CALLS), None, 0
            if _loads(s[j:end]) not in tools:
                return NOT_CALLS, None, 0
            call.name = _loads(s[j:end])
        else:
            if s[j] not in '{"':
                return NOT_CALLS, None, 0
            if end is None:
                return MAYBE, None, 0
            args = s[j:end] if s[j] == "{" else _loads(s[j:end])
            if not isinstance(args, str) or not isinstance(_loads(args), dict):
                return NOT_CALLS, None, 0
            call.arguments = args
        j = end


def _loads(s: str):
    """The JSON value of s, or None where it is not JSON."""
    try:
        return json.loads(s)
    except ValueError:
        return None


def _checked(text: str, final: bool, start: int, calls: list[PartialCall]) -> Parsed:
    """Content before the first call; at the end, calls that do not parse make it all content."""
    if final:
        for c in calls:
            if not c.complete or c.arguments is None or not _is_json(c.arguments):
                return Parsed(text)
    return Parsed(text[:start].rstrip(WS), calls)


def _not_calls(text: str, final: bool, start: int) -> Parsed:
    return Parsed(text if final else text[:start].rstrip(WS))


def _is_json(s: str) -> bool:
    try:
        json.loads(s)
        return True
    except ValueError:
        return False


class OpenAIParser(ToolParser):
    """gpt-oss's calls (vLLM's openai parser): harmony messages to a function, read from
    `to=functions.NAME<|message|>ARGS<|call|>` (what the harmony reasoning parser passes
    into the answer; a raw harmony answer's header may hold more between the name and
    `<|message|>`)."""

    name = "openai"
    skip_special_tokens = False  # harmony's tags are special tokens
    OPEN, MESSAGE, ENDS = "to=functions.", H_MESSAGE, H_ENDS

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return Parsed(text if final else text[:_held_back(text, (self.OPEN,))])
        calls, i = [], start
        while True:
            i += len(self.OPEN)
            m = text.find(self.MESSAGE, i)
            if m < 0:
                break  # the header goes on: no name yet
            name = text[i:m].replace("<|", " ").split()
            j = skip_ws(text, m + len(self.MESSAGE))
            ends = [(k, tag) for tag in self.ENDS if (k := text.find(tag, j)) >= 0]
            call = PartialCall(name=name[0] if name else "")
            calls.append(call)
            if not ends:  # the arguments so far, less what may begin the end tag
                call.arguments = text[j:][:_held_back(text[j:], self.ENDS)]
                break
            k, tag = min(ends)
            call.arguments, call.complete = text[j:k].rstrip(WS), True
            nxt = text.find(self.OPEN, k + len(tag))
            if nxt < 0:
                break
            i = nxt
        return _checked(text, final, start, calls)


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, OpenAIParser)}
TOOL_CALL_PARSERS = ("auto", *PARSERS)


def parser_for_template(name: str, chat_template: str | None) -> ToolParser:
    """The parser named by --tool-call-parser, or ("auto") the one the template's own format
    asks for; hermes where the template says nothing (servelm then describes the tools)."""
    if name != "auto":
        if name not in PARSERS:
            raise ValueError(f"tool call parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {name!r}")
        return PARSERS[name]()
    t = chat_template or ""
    if "<|channel|>" in t:  # gpt-oss's harmony format
        return OpenAIParser()
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or "ipython" in t:
        return Llama3JsonParser()
    return HermesParser()


# ---- what the model is told, and the grammar of forced calls ----------------------------------


def tool_system_prompt(tools: list[dict]) -> str:
    """The Hermes-style tool description, for a template that does not render `tools`."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


# Calls are written compactly (a small model left free to add whitespace may add it forever).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _parameters(function: dict) -> dict:
    """A function's parameters schema; an object schema that does not say whether other keys
    are allowed allows none (as OpenAI's strict mode reads it)."""
    schema = dict(function.get("parameters") or {"type": "object", "properties": {}})
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def forced_schema(functions: list[dict], named: str | None, parallel: bool) -> dict:
    """The JSON schema the answer must match: the named function's parameters, or an array
    of one or more (exactly one without parallel calls) {"name", "parameters"} objects."""
    if named is not None:
        schema = next(_parameters(f) for f in functions if f["name"] == named)
    else:
        items = [{"type": "object",
                  "properties": {"name": {"const": f["name"]}, "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for f in functions]
        schema = {"type": "array", "minItems": 1,
                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
    return {**schema, "x-guidance": COMPACT_JSON}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- streaming ---------------------------------------------------------------------------------


@dataclass
class CallDelta:
    """One streamed piece of a call: its header (id and name) the first time, then arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolCallStream:
    """One choice's stream: feed the whole text so far, get the new content and call pieces."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel
        self.content_sent = 0
        self.ids: list[str] = []    # per call whose header went out
        self.args_sent: list[int] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        parsed = self.parser.parse(text, final)
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        calls = parsed.calls if self.parallel else parsed.calls[:1]
        deltas = []
        for k, call in enumerate(calls):
            if call.name is None:
                break
            if k == len(self.ids):
                self.ids.append(self.parser.new_call_id())
                self.args_sent.append(0)
                deltas.append(CallDelta(k, self.ids[k], call.name))
            args = call.arguments or ""
            if len(args) > self.args_sent[k]:
                piece = args[self.args_sent[k]:]
                if deltas and deltas[-1].index == k:
                    deltas[-1].arguments = piece
                else:
                    deltas.append(CallDelta(k, arguments=piece))
                self.args_sent[k] = len(args)
        return content, deltas

    @property
    def called(self) -> bool:
        return bool(self.ids)
