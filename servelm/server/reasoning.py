"""Reasoning models: the thought (`<think>...</think>`, or gpt-oss's analysis channel) split
from the answer (no torch).

vLLM's parser names. qwen3: a thought is what the answer opens with `<think>` (Qwen3's
thinking mode); absent the tags, all of it is the answer. deepseek_r1: the answer starts
inside a thought (DeepSeek-R1's template opens `<think>` in the prompt; a `<think>` the model
writes first anyway is dropped) that lasts until `</think>`; absent it, all of it is thought.
Either way the prompt has the last word: a prompt whose generation prompt left `<think>`
open (Qwen3-Thinking, R1 distills) starts the answer inside the thought, one that closed it
(Qwen3's enable_thinking false) starts it in the answer.

Only the first thought is one: after `</think>` every byte is the answer's. The thought loses
its surrounding blank space and the answer the blank space that opens it (as Qwen3's template
strips them when it renders a past turn).

The API other adapters use: `ReasoningParser.for_prompt(prompt)`, then `split(text)` for a
whole answer or `stream()` for one fed delta by delta; both give the same text at every chunk
boundary (a tag split across deltas is held back, never leaked into either field).
`answer_grammar(spec)`: a structured-outputs constraint moved behind the thought.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from servelm.structured_outputs import StructuredOutputsParams, bounded_schema

START, END = "<think>", "</think>"
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1", "openai_gptoss")

# gpt-oss's harmony format (vLLM's openai_gptoss): the answer is messages, each a header
# `<|channel|>NAME[ to=...][<|constrain|>...]<|message|>` then its text up to `<|end|>`
# (`<|return|>` or `<|call|>` at the last), the next one after `<|start|>assistant`. The
# analysis channel's text is the thought; every other channel's (final, commentary) the answer;
# a message to a function (`to=functions.NAME` in its header) passes into the answer as
# `to=functions.NAME<|message|>ARGS<|call|>`, for the openai tool parser.
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_H_TAGS = (H_START, H_CHANNEL, H_MESSAGE, *H_ENDS)
_RECIPIENT = re.compile(r"to=([^\s<]+)")

# Where a stream is: before any thought, inside the thought, in the answer after it.
_BEFORE, _THINKING, _AFTER = "before", "thinking", "after"


def _partial(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held until we know)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _SplitStream:
    """An answer read delta by delta: feed(delta) -> (reasoning, content) new this delta,
    with final=True also what was held back at the end (finish())."""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        reasoning, content = self._feed(delta)
        if final:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _feed(self, delta: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError


class ReasoningStream(_SplitStream):
    """One answer read delta by delta: feed(delta) -> (reasoning, content) new this delta,
    with final=True also what was held back at the end (finish()). Joined, they equal
    ReasoningParser.split."""

    def __init__(self, state: str):
        self._state = state
        self._fresh = True  # nothing of the current part sent yet (its opening space dropped)
        self._held = ""

    def _feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning, content = [], []
        while text:
            if self._state == _BEFORE:
                i = text.find(START)
                if i < 0:
                    keep = _partial(text, START)
                    content.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
                content.append(text[:i])
                text = text[i + len(START):]
                self._state, self._fresh = _THINKING, True
            elif self._state == _THINKING:
                if self._fresh:
                    text = text.lstrip()
                    if text.startswith(START):  # the model opens what the prompt opened
                        text = text[len(START):]
                        continue
                    if not text or START.startswith(text) or END.startswith(text):
                        self._held = text
                        break
                    self._fresh = False
                i = text.find(END)
                if i >= 0:
                    reasoning.append(text[:i].rstrip())
                    text = text[i + len(END):]
                    self._state, self._fresh = _AFTER, True
                    continue
                keep = _partial(text, END)
                body = text[:len(text) - keep]
                sent = body.rstrip()  # trailing space waits: it may end the thought
                reasoning.append(sent)
                self._held = body[len(sent):] + text[len(text) - keep:]
                break
            else:
                if self._fresh:
                    text = text.lstrip()
                    if not text:
                        break
                    self._fresh = False
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the answer: text held back (a tag's beginning) is plain text after all."""
        held, self._held = self._held, ""
        if self._state == _THINKING:
            return held.rstrip(), ""
        return "", held


class HarmonyStream(_SplitStream):
    """ReasoningStream's API over gpt-oss's harmony messages (the answer read with its
    special tokens as text): an analysis message's text to the reasoning, any other
    channel's to the content, the headers and tags to neither. An answer that does not open
    with a harmony tag (a model ignoring its format) is all content."""

    def __init__(self):
        self._state = "before"  # before | header | body | plain
        self._held = ""          # the text not yet given out (a tag's possible start)
        self._header = ""        # the current message's header so far
        self._analysis = False   # the current message's channel is analysis
        self._call = False       # the current message is addressed to a function

    def _feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning, content = [], []
        while text:
            if self._state == "plain":
                content.append(text)
                break
            if self._state == "before":
                stripped = text.lstrip()
                if stripped.startswith((H_START, H_CHANNEL)):
                    self._state, text = "header", stripped
                    continue
                if any(t.startswith(stripped) for t in (H_START, H_CHANNEL)):
                    self._held = text  # could still open a header
                    break
                self._state = "plain"
                continue
            if self._state == "header":
                i = text.find(H_MESSAGE)
                if i < 0:
                    keep = _partial(text, H_MESSAGE)
                    self._header += text[:len(text) - keep]
                    self._held = text[len(text) - keep:]
                    break
                header, self._header = self._header + text[:i], ""
                channel = header.rpartition(H_CHANNEL)[2].split("<|")[0].split()
                recipient = _RECIPIENT.search(header)
                self._call = bool(recipient) and recipient.group(1).startswith("functions.")
                self._analysis = not self._call and bool(channel) and channel[0] == "analysis"
                if self._call:  # the call passes into the answer for the tool parser
                    content.append(f"to={recipient.group(1)}{H_MESSAGE}")
                self._state, text = "body", text[i + len(H_MESSAGE):]
                continue
            # body: up to the message's end (or a next header the model opened without one)
            ends = [(j, tag) for tag in (*H_ENDS, H_START, H_CHANNEL)
                    if (j := text.find(tag)) >= 0]
            if ends:
                j, tag = min(ends)
                (reasoning if self._analysis else content).append(text[:j])
                if self._call:
                    content.append(H_ENDS[2])
                text = text[j + len(tag):] if tag in H_ENDS else text[j:]
                self._state = "header"
                continue
            keep = max(_partial(text, tag) for tag in _H_TAGS)
            (reasoning if self._analysis else content).append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The end of the answer: a held tag's start is text after all (in the body or a
        plain answer); an unfinished header is dropped."""
        held, self._held = self._held, ""
        if self._state == "body":
            return (held, "") if self._analysis else ("", held)
        if self._state in ("plain", "before"):
            return "", held
        return "", ""


@dataclass(frozen=True)
class ReasoningParser:
    """A reasoning format (`name`, vLLM's) and where an answer starts: `state` is set for one
    prompt by for_prompt (chat.prepare puts that one on Prepared.reasoning_parser)."""

    name: str
    state: str

    @property
    def skip_special_tokens(self) -> bool:
        """Whether answers are read without the special tokens (harmony's tags are some)."""
        return self.name != "openai_gptoss"

    def for_prompt(self, prompt: str) -> "ReasoningParser":
        """This parser for answers to `prompt`: inside a thought when the prompt ends in an
        open one, in the answer when it closed one, else the format's own start (harmony:
        always its own)."""
        if self.name == "openai_gptoss":
            return self
        opened, closed = prompt.rfind(START), prompt.rfind(END)
        if opened > closed:
            return replace(self, state=_THINKING)
        if closed >= 0 and prompt.rstrip().endswith(END):
            return replace(self, state=_BEFORE)
        return replace(self, state=_THINKING if self.name == "deepseek_r1" else _BEFORE)

    @property
    def thinks_first(self) -> bool:
        """Whether the answer begins inside a thought (else one may still be opened)."""
        return self.state == _THINKING

    def stream(self) -> ReasoningStream | HarmonyStream:
        return HarmonyStream() if self.name == "openai_gptoss" else ReasoningStream(self.state)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer -> (the thought, or None if there was none or it was empty; the
        answer's text)."""
        reasoning, content = self.stream().feed(text, final=True)
        return reasoning or None, content

    def answer_grammar(self, spec: StructuredOutputsParams) -> StructuredOutputsParams:
        """`spec` applied to the answer after the thought: a Lark grammar whose thought is any
        text up to `</think>` (the thought itself optional when the answer may open one).
        ValueError for a spec given as a grammar of its own (it cannot be nested here)."""
        if self.name == "openai_gptoss":
            raise ValueError("structured outputs are not supported with gpt-oss's harmony "
                             "format (its answer follows an analysis message); use "
                             "--reasoning-parser none to constrain the whole output")
        if spec.kind == "grammar":
            raise ValueError("a grammar cannot be applied behind the thought of a reasoning "
                             "model; use a JSON schema, regex or choice, or send "
                             "chat_template_kwargs {\"enable_thinking\": false}")
        if spec.kind in ("json", "json_object"):
            schema = spec.json if spec.kind == "json" else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            answer = "%json " + json.dumps(bounded_schema(schema))  # compact, bounded
        elif spec.kind == "regex":
            answer = "/" + spec.regex.replace("/", "\\/") + "/"
        else:
            answer = " | ".join(json.dumps(c) for c in spec.choice)
        thought = 'thought "\\n"{0,2}'
        opening = thought if self.thinks_first else f'("{START}" {thought})?'
        return StructuredOutputsParams(grammar="\n".join([
            f"start: {opening} answer",
            f"thought[lazy]: /(?s:.*){END.replace('/', chr(92) + '/')}/",
            f"answer: {answer}"]))


def parser_for_template(name: str, chat_template: str | None) -> ReasoningParser | None:
    """The parser --reasoning-parser names, or (auto) openai_gptoss where the chat template
    writes harmony's `<|channel|>` (gpt-oss), qwen3 where it writes `<think>` (Qwen3, R1
    distills: for_prompt sees the thought the prompt opens), deepseek_r1 where it only
    strips `</think>` from past turns (the first R1 distills, whose answers open with a
    thought without the tag); none elsewhere."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {name!r}")
    if name == "auto":
        t = chat_template or ""
        name = ("openai_gptoss" if H_CHANNEL in t else "qwen3" if START in t
                else "deepseek_r1" if END in t else "none")
    if name == "none":
        return None
    return ReasoningParser(name, _THINKING if name == "deepseek_r1" else _BEFORE)
