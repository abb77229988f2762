"""Run by .venv-vllm's python (tests/frontend/tools/test_tool_parsers_compare.py): vLLM 0.32's
own parser classes on the texts and steps read from stdin; their answers on stdout,
as JSON, ids left out."""

import json
import sys

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.llama_tool_parser import Llama3JsonToolParser


class Tokenizer:
    def get_vocab(self):
        return {"<|python_tag|>": 0}


PARSERS = {"hermes": Hermes2ProToolParser, "llama3_json": Llama3JsonToolParser}


def run(case):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], model="m")
    cls = PARSERS[case["parser"]]
    info = cls(Tokenizer()).extract_tool_calls(case["text"], request)
    whole = {"tools_called": info.tools_called, "content": info.content,
             "calls": [[c.function.name, c.function.arguments] for c in info.tool_calls]}
    parser, prev, deltas = cls(Tokenizer()), "", []
    for delta in case["deltas"]:
        m = parser.extract_tool_calls_streaming(prev, prev + delta, delta, [], [], [], request)
        prev += delta
        if m is None:
            deltas.append(None)
            continue
        d = json.loads(m.model_dump_json(exclude_unset=True))
        for t in d.get("tool_calls", []):
            t.pop("id", None)
        deltas.append(d)
    return {"whole": whole, "deltas": deltas, "remaining": parser.get_remaining_unstreamed_args()}


def run_forced(case):
    """The JSON-forced path (VLLM_ENFORCE_STRICT_TOOL_CALLING=0): "required" arrays."""
    from pydantic import TypeAdapter, ValidationError
    from vllm.entrypoints.generate.base.protocol import FunctionDefinition
    from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

    try:
        parsed = TypeAdapter(list[FunctionDefinition]).validate_json(case["text"])
        whole = [[c.name, json.dumps(c.parameters, ensure_ascii=False)] for c in parsed]
    except ValidationError:
        whole = []
    prev, deltas = "", []
    for delta in case["deltas"]:
        m, _ = extract_required_tool_call_streaming(previous_text=prev, current_text=prev + delta, tool_call_idx=None,
                                                    tool_call_id_type="random")
        prev += delta
        d = None if m is None else json.loads(m.model_dump_json(exclude_unset=True))
        for t in (d or {}).get("tool_calls", []):
            t.pop("id", None)
        deltas.append(d)
    return {"whole": whole, "deltas": deltas}


print(json.dumps([run_forced(c) if c["parser"] == "required" else run(c) for c in json.load(sys.stdin)]))
