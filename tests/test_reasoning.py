"""Thinking: a chat completion's reasoning (before `</think>`) comes back as `reasoning_content`, its answer as
`content` (vLLM's Qwen3 reasoning parser's shape), streamed or not, whether the completion or the prompt opened
`<think>`; tool calls are read from the answer; a model that does not think is all content; `chat_template_kwargs`
reaches the chat template (enable_thinking), as `clover generate --no-think` does."""

import json

import pytest
from starlette.testclient import TestClient

from clover_jax.commands import generate as gen_cmd
from clover_jax.serving import reasoning
from clover_jax.serving.api import make_app
from clover_jax.tokenizer import ByteTokenizer
from clover_jax.tokenizer.chat_template import render_chat_template
from tests.test_serve_tools import ADD, CALL, ScriptedEngine

# A Qwen3-style generation prompt: thinking on leaves the model to open `<think>`; off closes an empty one.
THINK_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not "
                  "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


class ThinkTokenizer(ByteTokenizer):
    chat_template = THINK_TEMPLATE

    def apply_chat_template(self, prompt, **template_vars):
        return render_chat_template(THINK_TEMPLATE, [{"role": "user", "content": prompt}], **template_vars)


def _openai(http: TestClient):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


@pytest.mark.parametrize("text,opened,want", [
    ("<think>a b</think>\n\nanswer", False, ("a b", "answer")),
    ("a b</think>answer", True, ("a b", "answer")),  # the prompt opened <think>
    ("plain answer", False, ("", "plain answer")),  # a model that does not think
    ("<think>cut short", False, ("cut short", "")),
])
def test_split_and_streaming_agree(text, opened, want):
    assert tuple(reasoning.split(text, True, opened)) == want
    got_r, got_c = "", ""  # released a character at a time while running: every prefix extends the last
    for n in range(len(text) + 1):
        r, c = reasoning.split(text[:n], n == len(text), opened)
        assert r.startswith(got_r) and c.startswith(got_c), (text[:n], r, c)
        got_r, got_c = r, c
    assert (got_r, got_c) == want


def test_chat_returns_reasoning_apart_streamed_or_not():
    engine = ScriptedEngine("I should greet.</think>\n\nHello there!")
    http = TestClient(make_app(engine, ThinkTokenizer(), "scripted"))
    client = _openai(http)
    msgs = [{"role": "user", "content": "Hi"}]
    out = client.chat.completions.create(model="scripted", messages=msgs, max_tokens=100)
    message = out.choices[0].message
    assert message.content == "Hello there!" and message.model_extra["reasoning_content"] == "I should greet."
    assert engine.prompts[-1].endswith("<|assistant|><think>\n")  # the template opened the reasoning
    reasoning_text, content = "", ""
    for chunk in client.chat.completions.create(model="scripted", messages=msgs, max_tokens=100, stream=True):
        delta = chunk.choices[0].delta
        reasoning_text += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning_text, content) == ("I should greet.", "Hello there!")
    # thinking off: the template closes an empty reasoning, the model's text is all answer
    body = {"model": "scripted", "messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}
    answer = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert engine.prompts[-1].endswith("<think>\n\n</think>\n\n") and "reasoning_content" not in answer
    assert answer["content"] == "I should greet.</think>\n\nHello there!"


def test_tool_calls_are_read_from_the_answer():
    engine = ScriptedEngine("<think>Use add.</think>\n" + CALL)
    client = _openai(TestClient(make_app(engine, ByteTokenizer(), "scripted")))
    out = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "2 + 3?"}],
                                         tools=[ADD], max_tokens=200)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == "Use add."
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}


def test_completions_keep_the_text_whole():
    http = TestClient(make_app(ScriptedEngine("<think>x</think>y"), ByteTokenizer(), "scripted"))
    out = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 50}).json()["choices"][0]
    assert out["text"] == "<think>x</think>y"


def test_generate_no_think_passes_enable_thinking_false():
    tok = ThinkTokenizer()
    on, off = gen_cmd.encode(tok, "Hi", chat=True), gen_cmd.encode(tok, "Hi", chat=True, think=False)
    assert tok.decode(on).endswith("<think>\n") and tok.decode(off).endswith("<think>\n\n</think>\n\n")
