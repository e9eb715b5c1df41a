"""Tool calling in `clover serve`: the request fields (clover_jax.serving.tools), the two call forms the
Qwen family writes (.tool_parse), rendering conversations with tools (.chat, tokenizer.chat_template), and
the HTTP layer end to end with the real `openai` client against a scripted engine that answers fixed text."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from clover_jax.serving.api import make_app
from clover_jax.serving.chat import Message, parse_messages, plain_prompt, render_messages
from clover_jax.serving.field_error import FieldError
from clover_jax.serving.requests import Event, Request
from clover_jax.serving.tool_parse import Parsed, ParsedCall, call_end, parse_calls
from clover_jax.serving.tools import ToolSpec, parse_tools
from clover_jax.tokenizer import ByteTokenizer
from clover_jax.tokenizer.chat_template import ChatTemplateError, render_chat_template

TEMPLATE = (Path(__file__).parent / "fixtures" / "templates" / "qwen_tools.jinja").read_text()
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
FIND = {"type": "function", "function": {"name": "find", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"},
                                     "exact": {"type": "boolean"}, "tags": {"type": "array"},
                                     "where": {"type": "object"}}, "required": ["query"]}}}
TOOLS = {t.name: t for t in parse_tools({"tools": [ADD, FIND]}).tools}


# --- request fields ----------------------------------------------------------------------------------

def test_parse_tools_defaults_and_choices():
    plan = parse_tools({"tools": [ADD, FIND]})
    assert [t.name for t in plan.tools] == ["add", "find"] and plan.choice == "auto" and plan.parallel
    assert plan.tools[0].description == "Add two integers." and plan.parses
    assert parse_tools({"tools": [ADD], "tool_choice": "none"}).parses is False
    named = parse_tools({"tools": [ADD, FIND], "tool_choice": {"type": "function", "function": {"name": "find"}},
                         "parallel_tool_calls": False})
    assert named.choice == "function" and named.forced == "find" and set(named.allowed()) == {"find"}
    assert not named.parallel
    assert parse_tools({}) is None and parse_tools({"tool_choice": "none"}) is None


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ({"tools": "add"}, "tools"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_parse_tools_errors_name_the_field(body, param):
    with pytest.raises(FieldError) as e:
        parse_tools(body)
    assert e.value.param == param


# --- the two call forms ------------------------------------------------------------------------------

def test_json_form_with_text_before_and_several_calls():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>{"name": "find", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>')
    assert parse_calls(text, TOOLS) == Parsed("Let me add.", (ParsedCall("add", {"a": 2, "b": 3}),
                                                              ParsedCall("find", {"query": "x"})))


def test_xml_form_converts_values_by_schema_type():
    text = ("<tool_call>\n<function=find>\n<parameter=query>\n 42 <b>\n</parameter>\n<parameter=limit>\n2.5\n"
            "</parameter>\n<parameter=exact>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=where>\n{\"k\": null}\n</parameter>\n</function>\n</tool_call>")
    parsed = parse_calls(text, TOOLS)
    assert parsed == Parsed("", (ParsedCall("find", {"query": " 42 <b>", "limit": 2.5, "exact": True,
                                                     "tags": ["a", 1], "where": {"k": None}}),))
    two = "<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n<parameter=b>\n-1\n</parameter>\n</function>\n"
    assert parse_calls(two + "</tool_call>", TOOLS).calls == (ParsedCall("add", {"a": 7, "b": -1}),)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>',  # a required key missing
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": "3"}}</tool_call>',  # a wrong type
    '<tool_call>{"name": "add", "arguments": {"a": true, "b": 3}}</tool_call>',  # a boolean is no integer
    '<tool_call>{"name": "sub", "arguments": {"a": 2, "b": 3}}</tool_call>',  # an unknown function
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}</tool_call>',  # bad JSON
    '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}',  # never closed
    "<tool_call>\n<function=add>\n<parameter=a>\ntwo\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n"
    "</tool_call>",  # an integer that is not one
    "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>",  # b missing
    "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n</tool_call>",
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><tool_call>{"name": "x"}</tool_call>',
])
def test_invalid_calls_leave_the_text(text):
    assert parse_calls(text, TOOLS) == Parsed(text)


def test_call_end_per_block():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert call_end("hi " + call[:20], 0, parallel=False) is None
    assert call_end("hi " + call + "junk", 0, parallel=False) == 3 + len(call)
    text = call + "\n"
    assert call_end(text, 0, parallel=True) is None  # this block opened the call: one more block
    assert call_end(text + "ok", len(text), parallel=True) == len(call)
    assert call_end(text + "<tool", len(text), parallel=True) is None  # a second call may be starting
    assert call_end(text + call, len(text), parallel=True) is None
    assert call_end(text + call + " ", len(text + call + " "), parallel=True) == 2 * len(call) + 1


# --- rendering ---------------------------------------------------------------------------------------

def _conversation() -> list[Message]:
    return parse_messages([
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}])


def test_plain_format_with_tools():
    tools = [ToolSpec("add", ADD["function"]["parameters"], "Add two integers."),
             ToolSpec("find", FIND["function"]["parameters"])]
    assert plain_prompt(_conversation(), tools) == (
        "tools:\nadd(a: integer, b: integer) - Add two integers.\n"
        "find(query: string, limit?: number, exact?: boolean, tags?: array, where?: object)\n"
        "system: Be terse.\nuser: What is 2 plus 3?\n"
        'assistant: <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
        "tool: <tool_response>5</tool_response>\nassistant:")


@dataclass
class _TemplateTokenizer(ByteTokenizer):
    chat_template: str = TEMPLATE


def test_template_renders_tools_calls_and_results():
    tools = [TOOLS["add"]]
    text = render_messages(_TemplateTokenizer(), _conversation(), tools)
    assert text.startswith("<|im_start|>system\nBe terse.")
    assert json.dumps({"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                                         "parameters": ADD["function"]["parameters"]}}) in text
    assert ("<|im_start|>assistant\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
            "<parameter=b>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    # what the model writes back in the template's own form parses into the call it was shown
    shown = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_calls(shown, TOOLS).calls == (ParsedCall("add", {"a": 2, "b": 3}),)
    no_tools = render_messages(_TemplateTokenizer(), parse_messages([{"role": "user", "content": "hi"}]))
    assert no_tools == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_refusal_is_an_error():
    with pytest.raises(ChatTemplateError, match="system message must come first"):
        render_chat_template(TEMPLATE, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


# --- the HTTP layer, with a scripted engine ------------------------------------------------------------

@dataclass(frozen=True)
class _Cfg:
    vocab_size: int = 260
    eos_token_id: int = 2
    name: str = "scripted"


@dataclass
class ScriptedEngine:
    """The Engine contract answering `reply` (byte tokens) in blocks of `block_length`, then the end token,
    from a thread per request; `prompts` records the prompt text of every request."""

    reply: str = ""
    block_length: int = 8
    max_prompt: int = 4096
    max_tokens: int = 256
    cfg: Any = field(default_factory=_Cfg)
    prompts: list[str] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)

    def submit(self, req: Request, on_event: Any) -> int:
        req.check(self.block_length, "prefix", self.cfg.vocab_size, self.max_prompt, self.max_tokens)
        self.prompts.append(ByteTokenizer().decode(list(req.prompt)))
        rid = len(self.prompts)
        ids = ByteTokenizer().encode(self.reply)[:req.max_tokens]

        def run() -> None:
            for i in range(0, max(len(ids), 1), self.block_length):
                last = i + self.block_length >= len(ids)
                on_event(Event(tuple(ids[i:i + self.block_length]), "stop" if last else None, i + 1))
        threading.Thread(target=run, daemon=True).start()
        return rid

    def cancel(self, rid: int) -> None:
        self.cancelled.append(rid)

    def stats(self) -> None:
        return None


def _client(reply: str) -> tuple[TestClient, ScriptedEngine]:
    engine = ScriptedEngine(reply)
    return TestClient(make_app(engine, ByteTokenizer(), "scripted")), engine


def _openai(http: TestClient) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
XML_CALL = "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n</parameter>\n" \
           "</function>\n</tool_call>"


@pytest.mark.parametrize("reply", [" " + CALL + " and then some text after it", XML_CALL])
def test_openai_client_gets_tool_calls(reply):
    http, engine = _client(reply)
    client = _openai(http)
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}]
    out = client.chat.completions.create(model="scripted", messages=msgs, tools=[ADD], max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert engine.prompts[0].startswith("tools:\nadd(a: integer, b: integer) - Add two integers.\nuser: What")
    assert engine.cancelled == ([1] if "after" in reply else [])  # ended at the block that closed the call

    # streamed: the chunks assemble into the same call
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model="scripted", messages=msgs, tools=[ADD], max_tokens=200,
                                                stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "add" and json.loads(calls[0]["arguments"]) == {"a": 2, "b": 3}
    assert calls[0]["id"].startswith("call_")

    # the next turn renders the call and its result, and plain text comes back as content
    engine.reply = "5"
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    out = client.chat.completions.create(model="scripted", messages=msgs, tools=[ADD])
    assert out.choices[0].message.content == "5" and out.choices[0].finish_reason == "stop"
    assert engine.prompts[-1].endswith(
        '\nassistant: <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
        "tool: <tool_response>5</tool_response>\nassistant:")


def test_parallel_calls_and_text_before():
    reply = "Sure.\n" + CALL + "\n" + CALL.replace('"b": 3', '"b": 4')
    http, _ = _client(reply)
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [ADD], "max_tokens": 256}
    out = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == "Sure."
    assert [json.loads(c["function"]["arguments"])["b"] for c in out["message"]["tool_calls"]] == [3, 4]
    assert len({c["id"] for c in out["message"]["tool_calls"]}) == 2
    one = http.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()["choices"][0]
    assert len(one["message"]["tool_calls"]) == 1
    streamed = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    events = [json.loads(line[5:]) for line in streamed.splitlines()
              if line.startswith("data:") and "[DONE]" not in line]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    # the streamed pieces, reassembled by index as a client does, are the non-streamed calls: names and arguments
    assembled: dict[int, dict[str, str]] = {}
    for tc in (tc for d in deltas for tc in d.get("tool_calls", [])):
        slot = assembled.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
        slot["id"] += tc.get("id") or ""
        slot["name"] += tc.get("function", {}).get("name") or ""
        slot["arguments"] += tc.get("function", {}).get("arguments") or ""
    assert list(assembled) == [0, 1]
    whole = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out["message"]["tool_calls"]]
    assert [(c["name"], json.loads(c["arguments"])) for c in assembled.values()] == whole
    assert whole == [("add", {"a": 2, "b": 3}), ("add", {"a": 2, "b": 4})]
    assert all(c["id"].startswith("call_") for c in assembled.values()) and assembled[0]["id"] != assembled[1]["id"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice, reply, finish", [
    ("none", CALL, "stop"),  # no parsing: the text as written
    ({"type": "function", "function": {"name": "find"}}, CALL, "stop"),  # not the forced function
    ("required", "I will not call anything.", "stop"),
    ("auto", CALL.replace('"b": 3', '"b": "3"'), "stop"),  # does not fit the schema
])
def test_calls_that_do_not_count_come_back_as_text(choice, reply, finish):
    http, _ = _client(reply)
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [ADD, FIND], "tool_choice": choice}
    out = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == finish and out["message"]["content"] == reply
    assert "tool_calls" not in out["message"]
    streamed = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    assert "tool_calls" not in streamed


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_errors_are_openai_400s_with_param(body, param):
    http, engine = _client("x")
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert engine.prompts == []


# --- the toy task ------------------------------------------------------------------------------------

def test_toy_task_rows_hold_calls_the_server_parses(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # the repository root: examples/
    from examples import toy_agent

    train, held = toy_agent.split(60, 10, seed=1)
    assert len(train) == 60 and len(held) == 10 and not {t.question for t in train} & {t.question for t in held}
    assert [[c.name for c in t.calls] for t in held[:5]] == [["square"], ["double"], ["square", "double"],
                                                            ["double", "square"], ["capital"]]
    chain = toy_agent.make_task(("square", "double"), {"x": 7}, "What is twice the square of {x}?")
    assert chain.question == "What is twice the square of 7?" and chain.answer == "98"
    assert chain.calls == (toy_agent.Call("square", {"x": 7}), toy_agent.Call("double", {"x": 49}))
    tools = {s.name: s for s in toy_agent.specs()}
    rows = toy_agent.sft_rows([chain])
    assert len(rows) == 3  # two calls, then the answer
    assert rows[0]["prompt"].startswith("tools:\nsquare(x: integer)\n") and rows[0]["prompt"].endswith(
        "user: What is twice the square of 7?\nassistant:")
    for row, call in zip(rows, chain.calls, strict=False):
        assert parse_calls(row["response"], tools).calls == (ParsedCall(call.name, call.arguments),)
    assert rows[1]["prompt"].endswith("tool: <tool_response>49</tool_response>\nassistant:")
    assert rows[2]["prompt"].endswith("tool: <tool_response>98</tool_response>\nassistant:")
    assert rows[2]["response"] == " 98" and parse_calls(rows[2]["response"], tools).calls == ()
    for t in train:
        assert len(toy_agent.sft_rows([t])) == len(t.calls) + 1 == len(toy_agent.turns(t))
    right = toy_agent.Episode(chain, answer=" 98", made=list(chain.calls))
    assert right.correct and right.through_the_tools
    skipped = toy_agent.Episode(chain, answer="98", made=[toy_agent.Call("double", {"x": 49})])
    assert skipped.correct and not skipped.through_the_tools  # a right answer not reached by the task's calls
    assert not toy_agent.Episode(chain, answer="97", made=list(chain.calls)).through_the_tools
    assert toy_agent.execute("square", {"y": 2}) == "error: bad call"
    assert toy_agent.execute("capital", {"country": "Peru"}) == "Lima"


def test_published_fixture_template_takes_tools_and_calls():
    """The published-form fixture's ChatML template (JSON call form) through HFTokenizer, as `clover serve` renders."""
    pytest.importorskip("tokenizers")
    from clover_jax.tokenizer import HFTokenizer

    tok = HFTokenizer(str(Path(__file__).parent / "fixtures" / "published" / "qwen3_5_moe_vl_tiny"))
    text = render_messages(tok, _conversation(), [TOOLS["add"]])
    assert '{"type": "function", "function": {"name": "add", "description": "Add two integers."' in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    shown = text[text.rindex("<tool_call>{"):]  # the first one is the instruction in the system turn
    call = shown[:shown.index("</tool_call>") + len("</tool_call>")]
    assert parse_calls(call, TOOLS).calls == (ParsedCall("add", {"a": 2, "b": 3}),)
