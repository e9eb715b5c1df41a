"""What a published Qwen3.5 chat template writes, read back by the server.

tests/fixtures/templates/qwen35_renderings.json holds conversations rendered by transformers' own renderer under
the chat template Qwen/Qwen3.5-35B-A3B publishes (the family Clover is built on); its recipe,
tests/fixtures/templates/record_qwen35.py, names the source and hash of the template and also checked, when it
ran, that the server's rendering equals transformers' on every conversation. Here, without the template: the
calls, the reasoning and the opened `<think>` of those renderings are read back by the server's parsers into what
the conversation said, and the test template the other tests serve with writes calls and tool results as the
published one does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from clover_jax.serving.chat import parse_messages, render_messages
from clover_jax.serving.field_error import FieldError
from clover_jax.serving.reasoning import prompt_opens_thinking, split
from clover_jax.serving.tool_parse import ParsedCall, parse_calls
from clover_jax.serving.tools import parse_tools

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
RECORD = json.loads((TEMPLATES / "qwen35_renderings.json").read_text())
TOOLS = parse_tools({"tools": RECORD["tools"]}).allowed()
CASES = RECORD["conversations"]
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>\n|$)", re.S)


def _assistant_turns(rendered: str) -> list[str]:
    """The bodies of the closed assistant turns of a rendering, in order (the generation prompt left out)."""
    return [m.group(2) for m in _TURN.finditer(rendered)
            if m.group(1) == "assistant" and m.group(0).endswith("<|im_end|>\n")]


def _pairs(case: dict) -> list[tuple[dict, str]]:
    """Each assistant message of a conversation with the turn the published template wrote for it."""
    messages = [m for m in case["messages"] if m["role"] == "assistant"]
    turns = _assistant_turns(case["rendered"])
    assert len(turns) == len(messages), "every assistant message is one closed turn of the rendering"
    return list(zip(messages, turns, strict=True))


def test_the_record_is_the_pinned_template_rendered_by_transformers():
    assert RECORD["template_sha256"] == "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"
    assert RECORD["renderer"] == "transformers.utils.chat_template_utils.render_jinja_template"
    assert sum(len(_pairs(c)) for c in CASES.values()) == 5


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["tools"]])
def test_published_calls_parse_back_to_the_calls_written(name):
    """Every call the published template wrote (text before them, parallel calls, a multi-line string, numbers,
    an object, an array, booleans and a null as the template spells them: True, False, None) parses back, through
    the server's reasoning split and tool parser, to the conversation's own call and content."""
    seen = 0
    for message, turn in _pairs(CASES[name]):
        content = split(turn, final=True).content
        parsed = parse_calls(content, TOOLS)
        calls = tuple(ParsedCall(c["function"]["name"], c["function"]["arguments"])
                      for c in message.get("tool_calls", []))
        assert parsed.calls == calls
        if calls:
            assert parsed.content == message["content"]
            seen += 1
    assert seen == (0 if name == "reasoning_in_content" else 1)


def test_every_argument_type_was_written_in_the_published_spelling():
    """The parallel-call case covers what the parser must read: Python's True / False / None, JSON objects."""
    turn = _assistant_turns(CASES["parallel_calls_thinking_off"]["rendered"])[0]
    for piece in ("<parameter=exact>\nFalse\n", "<parameter=cursor>\nNone\n", "<parameter=filters>\n{\"year\"",
                  "<parameter=query>\ntides\nand moons\n</parameter>"):
        assert piece in turn


@pytest.mark.parametrize("name", list(CASES))
def test_a_published_generation_prompt_opens_thinking_unless_turned_off(name):
    case = CASES[name]
    opens = case["kwargs"].get("add_generation_prompt", True) and case["kwargs"].get("enable_thinking", True)
    assert prompt_opens_thinking(case["rendered"]) is bool(opens)


@pytest.mark.parametrize("name, reasoning, content", [
    ("reasoning_in_content", "It has no divisor but 1 and 7.", "Yes."),
    ("agent_step_with_reasoning", "I need today's weather in Bergen.", ""),
    ("parallel_calls_thinking_off", "", "Let me look both up."),
])
def test_published_reasoning_splits_back(name, reasoning, content):
    """An assistant turn after the last question, as the published template writes it (`<think>` reasoning
    `</think>` then the answer), splits into the reasoning and the answer that were given."""
    (_, turn), = [(m, t) for m, t in _pairs(CASES[name]) if t.startswith("<think>")]
    got = split(turn, final=True)
    assert got.reasoning.strip("\n") == reasoning
    assert parse_calls(got.content, TOOLS).content == content


def _served(template: str, case: dict) -> str:
    variables = {k: v for k, v in case["kwargs"].items() if k != "add_generation_prompt"}
    tools = parse_tools({"tools": RECORD["tools"]}).tools if case["tools"] else ()
    return render_messages(SimpleNamespace(chat_template=template), parse_messages(case["messages"]), tools,
                           variables)


def _calls_and_results(rendered: str) -> tuple[list[str], list[str]]:
    turns = [m for m in _TURN.finditer(rendered) if m.group(1) != "system"]
    calls = [c for m in turns for c in re.findall(r"<tool_call>.*?</tool_call>", m.group(2), re.S)]
    results = [m.group(2) for m in turns if m.group(1) == "user" and m.group(2).startswith("<tool_response>")]
    return calls, results


@pytest.mark.parametrize("name", list(CASES))
def test_the_test_template_writes_calls_and_results_as_published(name):
    """tests/fixtures/templates/qwen_tools.jinja (written for the tests) renders, through the server's own path,
    every call and every group of tool results exactly as the published template did."""
    case = CASES[name]
    ours = _served((TEMPLATES / "qwen_tools.jinja").read_text(), case)
    calls, results = _calls_and_results(case["rendered"])
    assert _calls_and_results(ours) == (calls, results)
    n_calls = sum(len(m.get("tool_calls", [])) for m in case["messages"])
    assert len(calls) == n_calls and len(results) == (1 if n_calls else 0)


def test_reasoning_sent_back_reaches_the_template():
    """An assistant message sent back with the reasoning the server returned keeps it for the template (the
    published template writes it into the turns after the last question: the recipe checked the whole rendering);
    reasoning in any other turn is refused by name."""
    messages = CASES["agent_step_with_reasoning"]["messages"]
    assert parse_messages(messages)[1].as_template()["reasoning_content"] == "I need today's weather in Bergen."
    assert "reasoning_content" not in parse_messages(messages)[0].as_template()
    bad = [{"role": "user", "content": "hi", "reasoning_content": "no"}]
    with pytest.raises(FieldError, match=r"messages\[0\]\.reasoning_content"):
        parse_messages(bad)
    with pytest.raises(FieldError, match="reasoning_content must be a string"):
        parse_messages([{"role": "assistant", "content": "", "reasoning_content": 3}])
