"""kvpool's tool-call parsers against vLLM 0.32's own classes (run by .venv-vllm's
python in a subprocess, tests/frontend/tools/vllm_tool_parser_run.py): the same texts, cut
into the same deltas, must give the same calls, content and streamed deltas (ids
aside: random in both)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from frontend.tools.parsers import get_tool_parser
from frontend.tools.parsers.forced_json import required_calls, required_delta

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = ROOT / ".venv-vllm/bin/python"


class Vocab:
    def get_vocab(self):
        return {"<|python_tag|>": 0}


HERMES = [
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"q": "é \\" }"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # the end tag never came
    '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',  # malformed
    'no calls at all, only a < and a <tool',
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
]
LLAMA = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "a", "arguments": {"x": [1, 2, {"y": "z"}]}}; {"name": "b", "parameters": {}}',
    'Sure: {"name": "a", "arguments": {}} done',
    '{"arguments": {"x": 1}}',
    "plain text",
    '{"name": "f", "arguments": {"s": "a\\nb", "n": -1.5e3, "t": true}}',
]


def steps(text: str, sizes: tuple[int, ...]) -> list[str]:
    """The text cut into deltas of the given sizes, cycled (as a detokenizer's steps)."""
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out.append(text[i : i + n])
        i, k = i + n, k + 1
    return out


# "required" under VLLM_ENFORCE_STRICT_TOOL_CALLING=0: the array its JSON schema makes the model write.
REQUIRED = [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "n": [1, {"x": "]}"}]}}, {"name": "get_time", "parameters": {}}]',
    '[{"parameters": {"a": "b"}, "name": "f"}]',  # parameters before the name
    '[{"name": "f", "parameters": 12}]',  # not an object: streamed, but no call whole
    '[{"name": "f", "parameters": null}, {"name": "g"}]',
    '[{"name": "f\\"q", "parameters": {"s": "x\\ny"}}] trailing',
    '{"name": "f"}',  # not an array
    '[{"name": "f", "parameters": {"a": 1}',  # cut short
]
CASES = [{"parser": p, "text": t, "deltas": steps(t, sizes)}
         for p, texts in (("hermes", HERMES), ("llama3_json", LLAMA), ("required", REQUIRED))
         for t in texts for sizes in ((1,), (3, 1, 7), (1000,))]


def ours_forced(case) -> dict:
    whole = [[c.name, c.arguments] for c in required_calls(case["text"])[0]]
    prev, deltas = "", []
    for delta in case["deltas"]:
        m = required_delta(prev, prev + delta, lambda: "id")
        prev += delta
        d = None if m is None else m.to_json()
        for t in (d or {}).get("tool_calls", []):
            t.pop("id", None)
        deltas.append(d)
    return {"whole": whole, "deltas": deltas}


def ours(case) -> dict:
    if case["parser"] == "required":
        return ours_forced(case)
    cls = get_tool_parser(case["parser"])
    info = cls(Vocab()).extract_tool_calls(case["text"])
    whole = {"tools_called": info.tools_called, "content": info.content, "calls": [[c.name, c.arguments] for c in info.tool_calls]}
    parser, prev, deltas = cls(Vocab()), "", []
    for delta in case["deltas"]:
        m = parser.extract_tool_calls_streaming(prev, prev + delta, delta)
        prev += delta
        d = None if m is None else m.to_json()
        for t in (d or {}).get("tool_calls", []):
            t.pop("id", None)
        deltas.append(d)
    return {"whole": whole, "deltas": deltas, "remaining": parser.get_remaining_unstreamed_args()}


@pytest.mark.compare
def test_same_calls_and_deltas_as_vllms_parsers(real_vllm):
    run = subprocess.run([str(VLLM_PYTHON), str(Path(__file__).with_name("vllm_tool_parser_run.py"))], input=json.dumps(CASES),
                         capture_output=True, text=True, timeout=300, env={"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                                                                           "VLLM_NO_USAGE_STATS": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    for case, want in zip(CASES, theirs, strict=True):
        assert ours(case) == want, (case["parser"], case["text"], case["deltas"][:5])
