"""Chat messages to prompt text (`clover_jax.serving.chat`): what `/v1/chat/completions` accepts and refuses in
`messages` (each refusal names its field, as OpenAI's 400 does), what a checkpoint's chat template receives, and
the plain format. Written for the mutation run (`bash scripts/mutation.sh chat`; docs/testing.md, "Mutation
score"); the HTTP side of the same is tests/test_serve_tools.py's and tests/test_serve_api.py's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from clover_jax.serving.chat import (
    CallMessage,
    Message,
    call_text,
    parse_messages,
    plain_prompt,
    render_messages,
    tool_line,
)
from clover_jax.serving.field_error import FieldError
from clover_jax.serving.tools import ToolSpec
from clover_jax.tokenizer import ByteTokenizer

ADD = ToolSpec("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}, "Add two integers.")
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


# --- messages: what is accepted ------------------------------------------------------------------------------

def test_content_forms():
    got = parse_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "user", "content": []}, {"role": "system"}])
    assert [m.content for m in got] == ["hi", "", "ab", "", ""]
    assert [m.role for m in got] == ["user", "assistant", "user", "user", "system"]


def test_an_assistant_call_and_the_tool_turn_that_answers_it():
    got = parse_messages([{"role": "assistant", "content": "Adding.", "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "5", "name": "add"}])
    assert got == [Message("assistant", "Adding.", (CallMessage("call_1", "add", {"a": 2, "b": 3}),)),
                   Message("tool", "5", (), "call_1", "add")]


@pytest.mark.parametrize(("call", "expected"), [
    ({"function": {"name": "add"}}, CallMessage("", "add", {})),  # id, type and arguments are optional
    ({"id": "c", "function": {"name": "add", "arguments": {"a": 1}}}, CallMessage("c", "add", {"a": 1})),
    ({"id": "c", "function": {"name": "add", "arguments": ""}}, CallMessage("c", "add", {})),
    ({"id": "c", "function": {"name": "add", "arguments": "  "}}, CallMessage("c", "add", {})),
    ({"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": "ü"}'}},
     CallMessage("c", "add", {"a": "ü"})),
])
def test_tool_call_forms(call, expected):
    (m,) = parse_messages([{"role": "assistant", "tool_calls": [call]}])
    assert m.tool_calls == (expected,)


def test_tool_calls_null_and_ids_outside_tool_turns():
    (m,) = parse_messages([{"role": "assistant", "content": "x", "tool_calls": None}])
    assert m.tool_calls == ()
    (m,) = parse_messages([{"role": "user", "content": "x", "tool_call_id": "call_1"}])
    assert m.tool_call_id is None  # only a tool turn answers a call
    (m,) = parse_messages([{"role": "user", "content": "x", "name": "alice"}])
    assert m.name == "alice"


# --- messages: what is refused, naming the field ------------------------------------------------------------

@pytest.mark.parametrize(("messages", "message", "param"), [
    ([], "messages must be a non-empty list of {role, content} objects", "messages"),
    ({"role": "user"}, "messages must be a non-empty list of {role, content} objects", "messages"),
    ([{"role": "user", "content": "a"}, "hi"], "messages[1] must be an object with role and content", "messages[1]"),
    ([{"content": "a"}], "messages[0].role must be a non-empty string", "messages[0].role"),
    ([{"role": "", "content": "a"}], "messages[0].role must be a non-empty string", "messages[0].role"),
    ([{"role": 3, "content": "a"}], "messages[0].role must be a non-empty string", "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list of text parts",
     "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "x"}]}],
     'messages[0].content[1] must be a text part {"type": "text", "text": ...}', "messages[0].content[1]"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}],
     'messages[0].content[0] must be a text part {"type": "text", "text": ...}', "messages[0].content[0]"),
    ([{"role": "user", "content": ["a"]}],
     'messages[0].content[0] must be a text part {"type": "text", "text": ...}', "messages[0].content[0]"),
    ([{"role": "user", "content": "a", "name": 5}], "messages[0].name must be a string", "messages[0].name"),
    ([{"role": "user", "content": "a", "tool_calls": [CALL]}],
     "messages[0].tool_calls is only allowed in assistant messages", "messages[0].tool_calls"),
    ([{"role": "tool", "content": "5"}],
     "messages[0].tool_call_id is required in tool messages (the id of the call answered)",
     "messages[0].tool_call_id"),
    ([{"role": "tool", "content": "5", "tool_call_id": ""}],
     "messages[0].tool_call_id is required in tool messages (the id of the call answered)",
     "messages[0].tool_call_id"),
    ([{"role": "tool", "content": "5", "tool_call_id": 7}],
     "messages[0].tool_call_id is required in tool messages (the id of the call answered)",
     "messages[0].tool_call_id"),
    ([{"role": "user", "content": "5", "tool_call_id": 7}], "messages[0].tool_call_id must be a string",
     "messages[0].tool_call_id"),
])
def test_malformed_messages_name_the_field(messages, message, param):
    with pytest.raises(FieldError) as e:
        parse_messages(messages)
    assert (str(e.value), e.value.param) == (message, param)


SHAPE = 'must be {"id", "type": "function", "function": {"name", "arguments"}}'


@pytest.mark.parametrize(("calls", "message", "param"), [
    ({"id": "c"}, "messages[1].tool_calls must be a list of tool calls", "messages[1].tool_calls"),
    ([CALL, "add"], f"messages[1].tool_calls[1] {SHAPE}", "messages[1].tool_calls[1]"),
    ([{"id": "c"}], f"messages[1].tool_calls[0] {SHAPE}", "messages[1].tool_calls[0]"),
    ([{"function": "add"}], f"messages[1].tool_calls[0] {SHAPE}", "messages[1].tool_calls[0]"),
    ([{"function": {"arguments": "{}"}}], f"messages[1].tool_calls[0] {SHAPE}", "messages[1].tool_calls[0]"),
    ([{"function": {"name": ""}}], f"messages[1].tool_calls[0] {SHAPE}", "messages[1].tool_calls[0]"),
    ([{"function": {"name": 5}}], f"messages[1].tool_calls[0] {SHAPE}", "messages[1].tool_calls[0]"),
    ([{"type": "code", "function": {"name": "add"}}], 'messages[1].tool_calls[0].type must be "function"',
     "messages[1].tool_calls[0].type"),
    ([{"id": 1, "function": {"name": "add"}}], "messages[1].tool_calls[0].id must be a string",
     "messages[1].tool_calls[0].id"),
    ([{"function": {"name": "add", "arguments": "{bad"}}],
     "messages[1].tool_calls[0].function.arguments is not valid JSON", "messages[1].tool_calls[0].function.arguments"),
    ([{"function": {"name": "add", "arguments": "[1, 2]"}}],
     "messages[1].tool_calls[0].function.arguments must be a JSON object (or a string holding one)",
     "messages[1].tool_calls[0].function.arguments"),
    ([{"function": {"name": "add", "arguments": 3}}],
     "messages[1].tool_calls[0].function.arguments must be a JSON object (or a string holding one)",
     "messages[1].tool_calls[0].function.arguments"),
])
def test_malformed_tool_calls_name_the_field(calls, message, param):
    with pytest.raises(FieldError) as e:
        parse_messages([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": calls}])
    assert (str(e.value), e.value.param) == (message, param)


# --- the plain format ----------------------------------------------------------------------------------------

def test_tool_lines():
    assert tool_line(ADD) == "add(a: integer, b: integer) - Add two integers."
    props = {"q": {"type": "string"}, "n": {"type": ["integer", "null"]}, "any": {}, "raw": True}
    spec = ToolSpec("find", {"type": "object", "properties": props, "required": ["q"]})
    assert tool_line(spec) == "find(q: string, n?: integer|null, any?: any, raw?: any)"
    assert tool_line(ToolSpec("now", {"type": "object"}, "")) == "now()"


def test_plain_turns():
    messages = [("system", "Be brief."), Message("user", "Add 2 and 3, then ü."),
                Message("assistant", "Sure.", (CallMessage("c1", "add", {"a": 2, "b": 3}),
                                               CallMessage("c2", "say", {"text": "ü"}))),
                Message("tool", "5", (), "c1"), Message("tool", "ü", (), "c2")]
    assert plain_prompt(messages) == (
        "system: Be brief.\nuser: Add 2 and 3, then ü.\n"
        'assistant: Sure.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        '<tool_call>{"name": "say", "arguments": {"text": "ü"}}</tool_call>\n'
        "tool: <tool_response>5</tool_response>\ntool: <tool_response>ü</tool_response>\nassistant:")
    assert plain_prompt([("user", "hi")], [ADD]) == "tools:\nadd(a: integer, b: integer) - Add two integers.\n" \
                                                    "user: hi\nassistant:"
    assert call_text("add", {}) == '<tool_call>{"name": "add", "arguments": {}}</tool_call>'


# --- what a checkpoint's chat template receives ---------------------------------------------------------------

@dataclass
class Templated(ByteTokenizer):
    """A tokenizer whose chat template shows what it was given."""

    chat_template: str = ("{{ messages | tojson }}|{{ tools | tojson }}|{{ add_generation_prompt }}|"
                          "{{ enable_thinking }}")


@dataclass
class OneTurn(ByteTokenizer):
    """A tokenizer that templates one user turn itself (as SentencePiece / HF tokenizers without jinja may)."""

    seen: list = field(default_factory=list)

    def apply_chat_template(self, prompt: str, **template_vars: Any) -> str | None:
        self.seen.append((prompt, template_vars))
        return f"<user>{prompt}</user>{template_vars}"


def test_the_template_gets_the_conversation_as_transformers_does():
    messages = parse_messages([{"role": "user", "content": "Add.", "name": "alice"},
                               {"role": "assistant", "content": "", "tool_calls": [CALL]},
                               {"role": "tool", "tool_call_id": "call_1", "content": "5"}])
    text = render_messages(Templated(), messages, [ADD], {"enable_thinking": False})
    shown, tools, generation, thinking = text.split("|")
    assert json.loads(shown) == [
        {"role": "user", "content": "Add.", "name": "alice"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"}]
    assert json.loads(tools) == [ADD.as_openai()] and generation == "True" and thinking == "False"
    assert render_messages(Templated(), messages[:1]).split("|")[1:] == ["null", "True", ""]  # no tools: none


def test_without_a_template_one_user_turn_is_the_tokenizers_and_the_rest_plain():
    tok = OneTurn()
    assert render_messages(tok, [Message("user", "hi")], (), {"enable_thinking": True}) == \
        "<user>hi</user>{'enable_thinking': True}"
    assert tok.seen == [("hi", {"enable_thinking": True})]
    assert render_messages(tok, [Message("user", "hi")], [ADD]) == plain_prompt([Message("user", "hi")], [ADD])
    two = [Message("system", "s"), Message("user", "hi")]
    assert render_messages(tok, two) == "system: s\nuser: hi\nassistant:"
    assert render_messages(tok, [Message("assistant", "x")]) == "assistant: x\nassistant:"
    called = [Message("user", "x", (CallMessage("c", "add", {}),))]  # a call in a user turn is no plain user turn
    assert render_messages(tok, called) == plain_prompt(called)
    assert len(tok.seen) == 1
    assert render_messages(ByteTokenizer(), [Message("user", "hi")]) == "user: hi\nassistant:"  # no template at all


def test_an_empty_template_is_no_template():
    """A tokenizer_config.json with `"chat_template": ""`: the plain format, not an empty prompt."""
    assert render_messages(Templated(chat_template=""), [Message("user", "hi")], [ADD]) == \
        plain_prompt([Message("user", "hi")], [ADD])
