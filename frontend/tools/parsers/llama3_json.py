"""``--tool-call-parser llama3_json`` (and ``llama4_json``; vLLM's
``Llama3JsonToolParser``): calls written as JSON objects ``{"name": ...,
"arguments"|"parameters": {...}}``, optionally after ``<|python_tag|>`` and separated
by "; ". Non-streamed, every top-level JSON object in the text is a call and the
rest is dropped; streamed, only a text that starts with one is parsed."""

from __future__ import annotations

import json
import logging

import partial_json_parser
from partial_json_parser.core.options import Allow

from frontend.tools.parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    find_common_prefix,
    is_complete_json,
    make_tool_call_id,
    partial_json_loads,
)

log = logging.getLogger("frontend")

BOT_TOKEN = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    structural_tag_model = "llama"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        if tokenizer.get_vocab().get(BOT_TOKEN) is None:
            raise RuntimeError(f"Llama3JsonToolParser could not locate the bot token '{BOT_TOKEN}' in the tokenizer.")

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if BOT_TOKEN not in model_output and "{" not in model_output:
            return ExtractedToolCalls(False, [], model_output)
        decoder = json.JSONDecoder()
        end_index = -1  # NOTE: a brace inside an object already read is not a new call
        tool_calls: list[ToolCall] = []
        start = model_output.find("{")
        while start != -1:
            if start > end_index:
                try:
                    obj, length = decoder.raw_decode(model_output[start:])
                    end_index = start + length
                    args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                    tool_calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
                except Exception:  # NOTE: as vLLM: one bad object makes the whole output content
                    log.exception("Error in extracting tool call from response.")
                    return ExtractedToolCalls(False, [], model_output)
            start = model_output.find("{", start + 1)
        if tool_calls:
            return ExtractedToolCalls(True, tool_calls, None)
        return ExtractedToolCalls(False, [], model_output)

    def _parse_calls(self, current_text: str) -> tuple[list[dict], list[bool]]:
        # NOTE: as OpenAI, a function's name is sent whole: strings stay unread until it is.
        flags = Allow.ALL if self.current_tool_name_sent else Allow.ALL & ~Allow.STR
        calls, complete = [], []
        start = len(BOT_TOKEN) if current_text.startswith(BOT_TOKEN) else 0
        while start < len(current_text):
            obj, end = partial_json_loads(current_text[start:], flags)
            complete.append(is_complete_json(current_text[start:start + end]))
            start += end + len("; ")
            if "parameters" in obj:
                assert "arguments" not in obj, "model generated both parameters and arguments"
                obj["arguments"] = obj["parameters"]
            calls.append(obj)
        return calls, complete

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str) -> DeltaMessage | None:
        if not (current_text.startswith(BOT_TOKEN) or current_text.startswith("{")):
            return DeltaMessage(delta_text)
        try:
            try:
                calls, complete = self._parse_calls(current_text)
            except partial_json_parser.core.exceptions.MalformedJSON:
                return None  # not enough text to read yet
            if not calls:
                return None
            current = calls[self.current_tool_id]
            if len(calls) > self.current_tool_id + 1:
                # A new call starts: first send what the JSON completion of the previous
                # one held back.
                delta = None
                if self.current_tool_id >= 0 and (args := current.get("arguments")):
                    args_json = json.dumps(args, ensure_ascii=False)
                    diff = args_json[len(self.streamed_args_for_tool[self.current_tool_id]):]
                    delta = DeltaMessage(None, [DeltaToolCall(self.current_tool_id, arguments=diff)], content_set=False)
                    self.streamed_args_for_tool[self.current_tool_id] += diff
                self.current_tool_id = len(calls) - 1
                self.current_tool_name_sent = False
                self.streamed_args_for_tool.append("")
                return delta  # NOTE: as vLLM, prev_tool_call_arr is not updated on this step
            delta = None
            if not self.current_tool_name_sent:
                if name := current.get("name"):
                    delta = DeltaMessage(None, [DeltaToolCall(self.current_tool_id, id=make_tool_call_id(), name=name)],
                                         content_set=False)
                    self.current_tool_name_sent = True
            elif args := current.get("arguments"):
                sent = len(self.streamed_args_for_tool[self.current_tool_id])
                args_json = json.dumps(args, ensure_ascii=False)
                prev_args = self.prev_tool_call_arr[self.current_tool_id].get("arguments")
                diff = None
                if complete[self.current_tool_id]:
                    diff = args_json[sent:]
                elif prev_args:
                    prev_json = json.dumps(prev_args, ensure_ascii=False)
                    if args_json != prev_json:
                        # NOTE: only the part two partial parses agree on: a completion's
                        # closing quotes and braces are not the model's yet.
                        diff = find_common_prefix(prev_json, args_json)[sent:]
                if diff is not None:
                    delta = DeltaMessage(None, [DeltaToolCall(self.current_tool_id, arguments=diff)], content_set=False)
                    self.streamed_args_for_tool[self.current_tool_id] += diff
            self.prev_tool_call_arr = calls
            return delta
        except Exception:
            log.exception("Error trying to handle streaming tool call.")
            return None
