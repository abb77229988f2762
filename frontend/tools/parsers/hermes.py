"""``--tool-call-parser hermes`` (vLLM's ``Hermes2ProToolParser``): calls written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the text before the
first one being the answer's content."""

from __future__ import annotations

import json
import logging
import re

from frontend.tools.parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    is_complete_json,
    make_tool_call_id,
    partial_tag_overlap,
)

log = logging.getLogger("frontend")

START, END = "<tool_call>", "</tool_call>"
# A call between the tags, or a last one the answer ended inside.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


class HermesToolParser(ToolParser):
    structural_tag_model = "hermes"
    # NOTE: as vLLM: <tool_call> is a special token in some checkpoints, and skipping
    # special tokens would hide the calls from the parser.
    keeps_special_tokens = True

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._sent_content_idx = 0  # how much of the text before the calls was streamed

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCalls:
        if START not in model_output:
            return ExtractedToolCalls(False, [], model_output)
        try:
            calls = [json.loads(a or b) for a, b in _TOOL_CALL.findall(model_output)]
            tool_calls = [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
        except Exception:  # NOTE: as vLLM: any malformed call makes the whole output content
            log.exception("Error in extracting tool call from response.")
            return ExtractedToolCalls(False, [], model_output)
        content = model_output[: model_output.find(START)]
        return ExtractedToolCalls(True, tool_calls, content or None)

    def _extract_content(self, current_text: str) -> str | None:
        """Text before the first call not yet sent, holding back what may be the start
        of a <tool_call> tag."""
        if START not in current_text:
            sendable = len(current_text) - partial_tag_overlap(current_text, START)
        else:
            sendable = current_text.index(START)
        if sendable > self._sent_content_idx:
            content = current_text[self._sent_content_idx:sendable]
            self._sent_content_idx = sendable
            return content
        return None

    @staticmethod
    def _tool_call_jsons(text: str) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each <tool_call> region so far."""
        out: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            body = start + len(START)
            end = text.find(END, body)
            if end != -1:
                out.append((text[body:end].strip(), True))
                pos = end + len(END)
                continue
            raw = text[body:]
            if overlap := partial_tag_overlap(raw, END):
                raw = raw[:-overlap]
            raw = raw.strip()
            # NOTE: valid JSON without its closing tag is a whole call whose tag is late.
            out.append((raw, is_complete_json(raw) if raw else False))
            break
        return out

    @staticmethod
    def _arguments(tc_json: str, complete: bool) -> str | None:
        """The arguments' text of a call's JSON (a complete one without the outer '}')."""
        match = _ARGUMENTS.search(tc_json)
        if not match:
            return None
        raw = tc_json[match.end():]
        if complete:
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    def _arguments_diff(self, index: int, tc_json: str, complete: bool) -> str | None:
        args = self._arguments(tc_json, complete)
        if args is None or len(args) <= len(self.streamed_args_for_tool[index]):
            return None
        diff = args[len(self.streamed_args_for_tool[index]):]
        self.streamed_args_for_tool[index] = args
        self.prev_tool_call_arr[index]["arguments"] = args
        return diff

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str) -> DeltaMessage | None:
        """Re-reads the whole text each step and sends what is new: content before the
        calls, each call's name once whole, then its argument text as it grows."""
        try:
            content = self._extract_content(current_text)
            deltas: list[DeltaToolCall] = []
            for i, (tc_json, complete) in enumerate(self._tool_call_jsons(current_text)):
                if i >= len(self.prev_tool_call_arr):
                    self.prev_tool_call_arr.append({})
                    self.streamed_args_for_tool.append("")
                if "name" not in self.prev_tool_call_arr[i]:
                    match = _NAME.search(tc_json)
                    if not match:
                        break  # NOTE: call i+1 waits for call i's name
                    self.prev_tool_call_arr[i]["name"] = match.group(1)
                    deltas.append(DeltaToolCall(i, id=make_tool_call_id(), name=match.group(1)))
                if diff := self._arguments_diff(i, tc_json, complete):
                    deltas.append(DeltaToolCall(i, arguments=diff))
            if content or deltas:
                return DeltaMessage(content, deltas)
            return None
        except Exception:
            log.exception("Error trying to handle streaming tool call.")
            return None
