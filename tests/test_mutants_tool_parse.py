"""Tool-call parsing (`clover_jax.serving.tool_parse`): the behaviours the mutation run found untested
(`bash scripts/mutation.sh tool_parse`; docs/testing.md, "Mutation score"). Each test is a case of the module's
documented contract that a model's output can hit: the `parameters` spelling of the JSON form, a call without
arguments, a parameter's text without newlines, untyped parameters, the block boundaries of `call_end`."""

from __future__ import annotations

import pytest

from clover_jax.serving.tool_parse import CLOSE, OPEN, Parsed, ParsedCall, call_end, parse_calls, pending_open
from clover_jax.serving.tools import ToolSpec

TOOLS = {t.name: t for t in (
    ToolSpec("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                     "required": ["a", "b"]}),
    ToolSpec("find", {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}),
    ToolSpec("now", {"type": "object", "properties": {}}),  # no arguments
    ToolSpec("note", {"type": "object"}),  # any arguments, none typed
    ToolSpec("wait", {"type": "object", "properties": {"seconds": {"type": ["integer", "null"]}}}),
)}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def xml(name: str, **params: str) -> str:
    inner = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


def test_text_without_a_call_is_the_content():
    assert parse_calls("The answer is 5.", TOOLS) == Parsed("The answer is 5.")


def test_json_form_takes_parameters_for_arguments():
    """Some templates (Llama's, older Hermes) write `parameters` where Qwen writes `arguments`."""
    text = '<tool_call>{"name": "add", "parameters": {"a": 4, "b": 5}}</tool_call>'
    assert parse_calls(text, TOOLS).calls == (ParsedCall("add", {"a": 4, "b": 5}),)


@pytest.mark.parametrize("body", ['{"name": "now"}', '{"name": "now", "arguments": ""}',
                                  '{"name": "now", "arguments": "  "}', '{"name": "now", "arguments": {}}'])
def test_json_call_without_arguments(body):
    """A tool without parameters: no `arguments`, an empty object or an empty string all mean {}."""
    assert parse_calls(f"<tool_call>{body}</tool_call>", TOOLS).calls == (ParsedCall("now", {}),)


@pytest.mark.parametrize("body", ['{"arguments": {"a": 1, "b": 2}}', '{"name": 7, "arguments": {}}',
                                  '{"name": null}'])
def test_json_call_without_a_name_is_text(body):
    """No function name (or not a string): the text comes back as content, never an exception (a 500)."""
    text = f"Sure. <tool_call>{body}</tool_call>"
    assert parse_calls(text, TOOLS) == Parsed(text)


def test_xml_text_outside_the_parameters_is_no_call():
    text = "<tool_call>\n<function=add>\nlet me think\n<parameter=a>1</parameter>\n<parameter=b>2</parameter>\n" \
           "</function>\n</tool_call>"
    assert parse_calls(text, TOOLS) == Parsed(text)


def test_xml_string_parameter_stays_text_even_when_it_reads_as_json():
    """A `string` parameter is the text as written: "42" stays "42", "true" stays "true"."""
    assert parse_calls(xml("find", query="\n42\n"), TOOLS).calls == (ParsedCall("find", {"query": "42"}),)
    assert parse_calls(xml("find", query="\ntrue\n"), TOOLS).calls == (ParsedCall("find", {"query": "true"}),)


def test_xml_value_without_newlines_is_kept_whole():
    """Only one newline at each end is dropped: a value written inline keeps its first and last characters."""
    assert parse_calls(xml("find", query="abc"), TOOLS).calls == (ParsedCall("find", {"query": "abc"}),)
    assert parse_calls(xml("find", query="\n\nab\n\n"), TOOLS).calls == (ParsedCall("find", {"query": "\nab\n"}),)
    assert parse_calls(xml("add", a="12", b="\n3"), TOOLS).calls == (ParsedCall("add", {"a": 12, "b": 3}),)


def test_xml_untyped_parameters_are_json_when_they_parse_else_text():
    text = xml("note", n="\n3\n", flags="\n[1, 2]\n", title="\nhello world\n")
    assert parse_calls(text, TOOLS).calls == (ParsedCall("note", {"n": 3, "flags": [1, 2], "title": "hello world"}),)


def test_xml_value_that_does_not_parse_as_its_type_is_no_call_even_if_null_is_allowed():
    assert parse_calls(xml("wait", seconds="\nnull\n"), TOOLS).calls == (ParsedCall("wait", {"seconds": None}),)
    assert parse_calls(xml("wait", seconds="\n5\n"), TOOLS).calls == (ParsedCall("wait", {"seconds": 5}),)
    text = xml("wait", seconds="\nfive\n")
    assert parse_calls(text, TOOLS) == Parsed(text)


def test_call_end_without_parallel_cuts_after_the_first_call():
    assert call_end(CALL + "\n" + CALL, 0, parallel=False) == len(CALL)
    assert call_end(CLOSE + " more", 0, parallel=False) == len(CLOSE)  # a closing tag at the very start counts


def test_call_end_parallel_blocks_that_split_the_opening_tag():
    text = CALL + "\nok"
    # the opening tag was whole before this block: the call closed in this block, cut now
    assert call_end(text, len(OPEN), parallel=True) == len(CALL)
    # this block wrote the tag's last character: it opened the call, so one more block
    assert call_end(text, len(OPEN) - 1, parallel=True) is None
    # a lone "<" may start the next call
    assert call_end(text + " <", len(text), parallel=True) is None


def test_pending_open_holds_back_what_may_start_a_tag():
    assert pending_open("The answer is 5.") == 0
    assert pending_open("Let me check <") == 1
    assert pending_open("Let me check <tool_cal") == len("<tool_cal")
    assert pending_open("Let me check " + OPEN[:-1]) == len(OPEN) - 1
    assert pending_open("a < b") == 0
