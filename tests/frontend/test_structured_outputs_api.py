"""Structured outputs end to end: a live `kvpool serve` of the tiny checkpoint, the
openai SDK, every kind of constraint on both endpoints. The model's weights are random,
so only the grammar can make these outputs well-formed; each must also end by itself
(finish_reason "stop": the grammar completed and allowed EOS)."""

from __future__ import annotations

import json
import re

import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"c": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["c", "n"],
    "additionalProperties": False,
}


def check_schema(value) -> None:
    """SCHEMA, checked by hand."""
    assert isinstance(value, dict) and set(value) == {"c", "n"}
    assert value["c"] in ("x", "y")
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 9


def complete(client, model, prompt="hello", max_tokens=200, **extra):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    return r.choices[0]


def chat(client, model, max_tokens=200, **kwargs):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=max_tokens,
                                       temperature=0, **kwargs)
    return r.choices[0]


def test_json_schema_output_parses_and_validates(client, model):
    c = complete(client, model, structured_outputs={"json": SCHEMA})
    assert c.finish_reason == "stop"
    check_schema(json.loads(c.text))
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    m = chat(client, model, response_format=rf)
    assert m.finish_reason == "stop"
    check_schema(json.loads(m.message.content))


def test_json_object_output_is_an_object(client, model):
    c = complete(client, model, prompt="the cat", response_format={"type": "json_object"})
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict)


def test_regex_output_matches(client, model):
    for prompt in ("hello", "the cat"):
        c = complete(client, model, prompt=prompt, structured_outputs={"regex": "[a-z]{2,6}-[0-9]{2}"})
        assert c.finish_reason == "stop" and re.fullmatch("[a-z]{2,6}-[0-9]{2}", c.text)


def test_choice_output_is_one_of_the_choices(client, model):
    choices = ["yes", "no", "maybe"]
    c = complete(client, model, structured_outputs={"choice": choices})
    assert c.finish_reason == "stop" and c.text in choices
    m = chat(client, model, extra_body={"structured_outputs": {"choice": choices}})
    assert m.finish_reason == "stop" and m.message.content in choices


def test_grammar_output_follows_it(client, model):
    c = complete(client, model, prompt="a b c", structured_outputs={"grammar": 'root ::= ("ab" | "cd")+ "."'})
    assert c.finish_reason == "stop" and re.fullmatch(r"(ab|cd)+\.", c.text)
    c = complete(client, model, prompt="a b c", structured_outputs={"grammar": 'start: "x" ("y" | "z")*'})  # Lark
    assert c.finish_reason == "stop" and re.fullmatch("x[yz]*", c.text)


def test_streamed_and_several_choices_follow_the_grammar(client, model):
    stream = client.completions.create(model=model, prompt="hello", max_tokens=200, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"json": SCHEMA}})
    check_schema(json.loads("".join(chunk.choices[0].text for chunk in stream if chunk.choices)))
    r = client.completions.create(model=model, prompt="the cat", max_tokens=40, temperature=1.0, n=3, seed=5,
                                  extra_body={"structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{2}"}})
    for c in r.choices:  # sampled, not greedy: still inside the grammar
        assert c.finish_reason == "stop" and re.fullmatch("[a-z]{2,6}-[0-9]{2}", c.text)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "Invalid grammar specification."),
        ({"structured_outputs": {"regex": "(a"}}, "Failed to transform regex into a grammar: "),
        ({"structured_outputs": {"json": "{bad"}}, "Invalid JSON grammar specification."),
        ({"response_format": {"type": "json_schema"}}, "When response_format type is 'json_schema'"),
    ],
)
def test_a_spec_that_cannot_compile_is_a_400(client, model, extra, message):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, model, max_tokens=5, **extra)
    assert e.value.status_code == 400 and e.value.body["message"].startswith(message)
    # nothing else changed: the server answers the next request
    assert complete(client, model, max_tokens=2).finish_reason == "length"
