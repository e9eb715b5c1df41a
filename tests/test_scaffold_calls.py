"""Tool calls written into the canvas (`serving.scaffold`): the frame and keys laid out as fixed tokens, the value
columns restricted by type, the call read back; and `clover serve`'s rewrite of a call the model did not write whole
and valid (or that `tool_choice` requires), end to end over HTTP against a scripted engine that fills scaffolds."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from starlette.testclient import TestClient

from clover_jax.serving.api import make_app
from clover_jax.serving.requests import Event, Request
from clover_jax.serving.scaffold import CallForms, drafted_tool, form_of, opening
from clover_jax.serving.tool_parse import ParsedCall
from clover_jax.serving.tools import parse_tools
from clover_jax.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
EOS = 2
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "fast": {"type": "boolean"},
                                     "mode": {"enum": ["walk", "ride"]}, "note": {"type": "string"}},
    "required": ["city", "fast", "mode"]}}}
SPECS = {t.name: t for t in parse_tools({"tools": [ADD, PICK]}).tools}


def _forms(form: str = "json", classes: int = 8, block: int = 8) -> CallForms:
    return CallForms(TOK, 260, EOS, classes, form, block)


def _fill(layout, values: dict[str, str]) -> list[int]:
    """The layout's tokens with each slot holding `values[key]` (its byte tokens, exactly the slot's length)."""
    out = list(layout.scaffold.tokens)
    for key, lo, hi in layout.slots:
        ids = TOK.encode(values[key])
        assert len(ids) == hi - lo, (key, values[key], hi - lo)
        out[lo:hi] = ids
    return out


def test_a_json_frame_holds_the_keys_and_typed_slots():
    forms = _forms()
    layout = forms.frame(SPECS["add"], {"a": 1, "b": 2})
    sc = layout.scaffold
    shown = "".join("_" if t < 0 else TOK.decode([t]) for t in sc.tokens[:layout.end])
    assert shown == '<tool_call>{"name": "add", "arguments": {"a": _, "b": __}}</tool_call>'
    assert set(sc.tokens[layout.end:]) == {EOS} and len(sc.tokens) % 8 == 0  # the end token to the block's end
    for _, lo, hi in layout.slots:
        for col in range(lo, hi):
            allowed = sc.allowed[sc.classes[col] - 1]
            assert sc.classes[col] > 0 and all(TOK.decode([t]) in "0123456789-" for t in allowed)
    assert all(c == 0 for c, t in zip(sc.classes, sc.tokens, strict=False) if t >= 0)  # fixed columns: no class
    filled = _fill(layout, {"a": "7", "b": "42"})
    assert forms.read(layout, filled) == ParsedCall("add", {"a": 7, "b": 42})
    assert json.loads(TOK.decode(filled[len("<tool_call>"):layout.end - len("</tool_call>")]))["arguments"] == {
        "a": 7, "b": 42}
    assert forms.read(layout, _fill(layout, {"a": "-", "b": "42"})) is None  # not a number: malformed


def test_strings_booleans_and_enums_and_the_xml_form():
    forms = _forms()
    layout = forms.frame(SPECS["pick"], {"city": 6, "fast": 4, "mode": 6})
    assert [k for k, _, _ in layout.slots] == ["city", "fast", "mode"]  # required keys only, in schema order
    sc = layout.scaffold
    city = [sc.allowed[sc.classes[c] - 1] for c in range(layout.slots[0][1], layout.slots[0][2])]
    assert {TOK.decode([t]) for t in city[0]} == {'"'} and {TOK.decode([t]) for t in city[-1]} == {'"'}
    assert '"' not in {TOK.decode([t]) for t in city[1]} and "<" not in {TOK.decode([t]) for t in city[1]}
    fast = {TOK.decode([t]) for t in sc.allowed[sc.classes[layout.slots[1][1]] - 1]}
    assert fast <= set("truefals") and {"t", "f"} <= fast
    got = forms.read(layout, _fill(layout, {"city": '"Oslo"', "fast": "true", "mode": '"ride"'}))
    assert got == ParsedCall("pick", {"city": "Oslo", "fast": True, "mode": "ride"})
    assert forms.read(layout, _fill(layout, {"city": '"Oslo"', "fast": "true", "mode": '"rude"'})) is None

    xml = _forms("xml")
    layout = xml.frame(SPECS["add"], {"a": 2, "b": 1})
    shown = "".join("_" if t < 0 else TOK.decode([t]) for t in layout.scaffold.tokens[:layout.end])
    assert shown == ("<tool_call>\n<function=add>\n<parameter=a>\n__\n</parameter>\n<parameter=b>\n_\n</parameter>\n"
                     "</function>\n</tool_call>")
    assert xml.read(layout, _fill(layout, {"a": "12", "b": "3"})) == ParsedCall("add", {"a": 12, "b": 3})


def test_sizes_come_from_the_draft_and_the_frame_goes_on_from_its_opening():
    forms = _forms()
    draft = 'Sure. <tool_call>{"name": "add", "arguments" {"a": 123, "b": 4}'  # broken: no colon, not closed
    assert forms.value_sizes(draft, SPECS["add"]) == {"a": 3, "b": 1}
    assert drafted_tool(draft, list(SPECS.values())) == SPECS["add"]
    ids = TOK.encode(draft)
    k = opening(ids, TOK.decode)
    assert TOK.decode(ids[:k]) == "Sure. <tool_call>"
    layout = forms.frame(SPECS["add"], forms.value_sizes(draft, SPECS["add"]), ids[:k])
    assert TOK.decode([t for t in layout.scaffold.tokens[:layout.end] if t >= 0]).startswith(
        'Sure. <tool_call>{"name": "add", "arguments": {"a": ')
    assert form_of(TOK) == "json"
    assert _forms(classes=1).frame(SPECS["pick"], {}) is None  # needs more token classes than the engine holds


@dataclass(frozen=True)
class _Cfg:
    vocab_size: int = 260
    eos_token_id: int = EOS
    name: str = "scripted"


@dataclass
class FillingEngine:
    """The Engine contract answering `reply` (byte tokens) to a plain request and, to a scaffolded one, its fixed
    tokens with each free column filled from `values` in turn (one character a column), then the end token."""

    reply: str = ""
    values: str = ""
    block_length: int = 8
    max_prompt: int = 4096
    max_tokens: int = 256
    scaffold_classes: int = 8
    cfg: Any = field(default_factory=_Cfg)
    requests: list[Request] = field(default_factory=list)

    def submit(self, req: Request, on_event: Any) -> int:
        req.check(self.block_length, "prefix", self.cfg.vocab_size, self.max_prompt, self.max_tokens,
                  scaffold_classes=self.scaffold_classes)
        self.requests.append(req)
        if req.scaffold is None:
            ids = TOK.encode(self.reply)[:req.max_tokens]
        else:
            fill = iter(TOK.encode(self.values))
            ids = [t if t >= 0 else next(fill) for t in req.scaffold.tokens]
            ids = ids[:ids.index(EOS)] if EOS in ids else ids

        def run() -> None:
            for i in range(0, max(len(ids), 1), self.block_length):
                last = i + self.block_length >= len(ids)
                on_event(Event(tuple(ids[i:i + self.block_length]), "stop" if last else None, i + 1))
        threading.Thread(target=run, daemon=True).start()
        return len(self.requests)

    def cancel(self, rid: int) -> None:
        pass

    def stats(self) -> None:
        return None


def _post(engine: FillingEngine, **body: Any) -> tuple[dict, str]:
    http = TestClient(make_app(engine, TOK, "scripted"))
    base = {"messages": [{"role": "user", "content": "add 12 and 3"}], "tools": [ADD, PICK], "max_tokens": 200}
    out = http.post("/v1/chat/completions", json={**base, **body}).json()["choices"][0]
    streamed = http.post("/v1/chat/completions", json={**base, **body, "stream": True}).text
    metrics = http.get("/metrics").text
    return out, streamed + metrics


def test_a_broken_call_is_rewritten_into_the_canvas():
    engine = FillingEngine(reply=' <tool_call>{"name": "add", "arguments": {"a": 12, "b": 3}', values="123")
    out, rest = _post(engine)
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    (call,) = out["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 12, "b": 3}
    rewrite = engine.requests[1]
    assert rewrite.scaffold is not None and rewrite.prompt == engine.requests[0].prompt
    assert TOK.decode([t for t in rewrite.scaffold.tokens if t >= 0]).startswith(' <tool_call>{"name": "add"')
    assert "arguments\": {\"a\": 12, \"b\": 3}" not in rest.split("clover_tool_calls_total")[0]  # no broken text
    assert 'clover_tool_calls_total{written="model",result="malformed"} 2' in rest
    assert 'clover_tool_calls_total{written="scaffold",result="valid"} 2' in rest  # (the plain and the streamed)


def test_a_whole_valid_call_stands_and_plain_text_is_left_alone():
    engine = FillingEngine(reply=' <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    out, rest = _post(engine)
    assert json.loads(out["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert all(r.scaffold is None for r in engine.requests)
    assert 'clover_tool_calls_total{written="model",result="valid"} 2' in rest
    engine = FillingEngine(reply="Fifteen.")
    out, _ = _post(engine)
    assert out["message"]["content"] == "Fifteen." and all(r.scaffold is None for r in engine.requests)


def test_tool_choice_required_and_named_are_enforced():
    engine = FillingEngine(reply="Fifteen.", values="1203")  # no call: the first tool, default sizes (2 digits)
    out, _ = _post(engine, tool_choice="required")
    assert out["finish_reason"] == "tool_calls"
    (call,) = out["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 12, "b": 3}
    reply = ' <tool_call>{"name": "pick", "arguments": {"city": "Rome", "fast": true, "mode": "walk"}}</tool_call>'
    engine = FillingEngine(reply=reply, values="4005")  # a valid call, of a tool the request does not allow
    out, _ = _post(engine, tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = out["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 40, "b": 5}
    engine = FillingEngine(reply=reply[:-14], values='"Oslo"true"ride"')  # broken: sized from the draft
    out, _ = _post(engine, tool_choice="required")
    (call,) = out["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "pick", {"city": "Oslo", "fast": True, "mode": "ride"})


def test_free_mode_leaves_a_broken_call_as_text():
    reply = ' <tool_call>{"name": "add", "arguments": {"a": 12, "b": 3}'
    engine = FillingEngine(reply=reply, scaffold_classes=0)
    out, rest = _post(engine)
    assert out["message"]["content"] == reply.strip() or out["message"]["content"] == reply
    assert len(engine.requests) == 2 and 'written="model",result="malformed"} 2' in rest


class RefusingEngine(FillingEngine):
    """Refuses every scaffolded request (a full queue, a draining server)."""

    def submit(self, req: Request, on_event: Any) -> int:
        if req.scaffold is not None:
            from clover_jax.serving.requests import QueueFull

            raise QueueFull("the queue is full")
        return super().submit(req, on_event)


class StallingEngine(FillingEngine):
    """Sends a scaffolded request's first block, then nothing (so the request's deadline passes mid-rewrite)."""

    def submit(self, req: Request, on_event: Any) -> int:
        if req.scaffold is None:
            return super().submit(req, on_event)
        self.requests.append(req)
        first = [t if t >= 0 else TOK.encode("1")[0] for t in req.scaffold.tokens[:self.block_length]]
        threading.Thread(target=lambda: on_event(Event(tuple(first), None, 1)), daemon=True).start()
        return len(self.requests)


def test_what_the_rewrite_must_not_do():
    # refused: the draft's end stands, its text whole
    reply = 'Let me see. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 3}'
    out, _ = _post(RefusingEngine(reply=reply))
    assert out["finish_reason"] == "stop" and out["message"]["content"] == reply.strip()
    # a call mentioned in the reasoning is no call: no rewrite under "auto"
    engine = FillingEngine(reply="<think>A <tool_call> would help; no.</think>\n\nIt is fifteen.", values="1203")
    out, _ = _post(engine)
    assert out["finish_reason"] == "stop" and out["message"]["content"] == "It is fifteen."
    assert all(r.scaffold is None for r in engine.requests)
    # required, the draft plain text: nothing of it streams, and the answer is the call alone
    engine = FillingEngine(reply="The answer is fifteen, I think so.", values="1203")
    out, rest = _post(engine, tool_choice="required")
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    assert "fifteen" not in rest
    # the first of two drafted calls is the one rewritten (its tool, its sizes), the second's name notwithstanding
    reply = (' <tool_call>{"name": "add", "arguments": {"a": 1, "b": 22}\n'
             '<tool_call>{"name": "pick", "arguments": {"city": "Ro')
    out, _ = _post(FillingEngine(reply=reply, values="935"))
    (call,) = out["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 9, "b": 35}
    # a string value drafted one token long still gets its two quotes' columns
    draft = '{"name": "pick", "arguments": {"city": 5, "fast": true, "mode": "walk"'
    layout = _forms().frame(SPECS["pick"], _forms().value_sizes("<tool_call>" + draft, SPECS["pick"]))
    assert layout is not None and layout.slots[0][2] - layout.slots[0][1] == 2


def test_a_deadline_in_the_middle_of_a_rewrite_sends_no_part_of_it():
    from clover_jax.serving.http_request import Limits

    for reply, choice, content in [("The answer is fifteen.", "required", ""),
                                   ('Hi. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 3}', "auto", "Hi.")]:
        engine = StallingEngine(reply=reply)
        http = TestClient(make_app(engine, TOK, "scripted", limits=Limits(request_timeout_s=1.0)))
        body = {"messages": [{"role": "user", "content": "add 12 and 3"}], "tools": [ADD, PICK], "max_tokens": 200,
                "tool_choice": choice}
        out = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert out["finish_reason"] == "length" and out["message"]["content"] == content, out
        assert "tool_calls" not in out["message"]
