"""The load generator's HTTP client of an OpenAI-compatible server (kvpool serve, or
vLLM), measuring as ``vllm bench serve`` does.

Requests stream (``stream_options.include_usage``): TTFT is the time to the first
chunk with content, ITL the gaps between content chunks, prompt, output and cached
prompt tokens come from the final ``usage`` (what the server counted). ``openai`` posts the dataset's token
ids as the prompt of ``/v1/completions`` (exactly the tokens a native client sends,
so prefixes are shared as intended); ``openai-chat`` sends them decoded to text
(with ``--tokenizer``) as one user message of ``/v1/chat/completions``.

It has the native client's interface (`connect`, `generate`, `abort`,
`sleep_unless_lost`, `close`), so the runner drives either.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import msgspec

from loadgen.request_result import SUCCESS_FINISH_REASONS, RequestResult, SchedulerUnreachable

# NOTE: msgspec, not json.loads: the client shares the cores with the server it measures.
_decode = msgspec.json.Decoder().decode


@dataclass(slots=True)
class HTTPRequestResult(RequestResult):
    """A RequestResult whose output length is the server's usage count (the HTTP
    stream carries text, not token ids)."""

    num_output_tokens: int = 0
    text: str = ""  # the answer's text, as streamed (kept for a chat's next round)

    @property
    def output_len(self) -> int:
        return self.num_output_tokens


class OpenAIClient:
    def __init__(self, base_url: str, endpoint: str, model: str | None, chat: bool, tokenizer=None, decode_prompts: bool = True):
        """decode_prompts: chat requests come as token ids, decoded with ``tokenizer`` (the
        server's root folder's when None); False: they come as messages (``send_messages``)."""
        self.decode_prompts = decode_prompts
        self.base_url = base_url.rstrip("/")
        self.endpoint = endpoint
        self.model = model
        self.chat = chat
        self.tokenizer = tokenizer
        self.lost: str | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task] = {}

    async def connect(self, timeout: float) -> None:
        """Wait for /health = 200 (bounded); learn the model name from /v1/models."""
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        deadline = time.monotonic() + timeout
        why = "no answer"
        while True:
            try:
                async with self._session.get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        break
                    why = f"/health answered {r.status}"
            except (aiohttp.ClientError, TimeoutError) as e:
                why = str(e) or type(e).__name__
            if time.monotonic() > deadline:
                await self.close()
                raise SchedulerUnreachable(f"cannot reach the server at {self.base_url} within {timeout:g} s: {why}")
            await asyncio.sleep(0.2)
        async with self._session.get(self.base_url + "/v1/models") as r:
            card = (await r.json())["data"][0]
        if self.model is None:
            self.model = card["id"]
        if self.chat and self.decode_prompts and self.tokenizer is None:
            from frontend.text.tokenizer import Tokenizer, TokenizerError

            try:
                self.tokenizer = Tokenizer(card.get("root") or card["id"])
            except TokenizerError as e:
                await self.close()
                raise SchedulerUnreachable(f"openai-chat decodes prompts to text: give --tokenizer DIR ({e})") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def abort(self, request_ids: list[str] | None = None) -> None:
        """Closing a request's connection aborts it at the server."""
        for rid in list(self._tasks) if request_ids is None else request_ids:
            task = self._tasks.get(rid)
            if task is not None:
                task.cancel()

    async def sleep_unless_lost(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def _body(self, prompt_token_ids: list[int], max_tokens: int, ignore_eos: bool) -> dict:
        if self.chat:
            return self._chat_body([{"role": "user", "content": self.tokenizer.decode(prompt_token_ids)}], max_tokens, ignore_eos)
        return {"prompt": prompt_token_ids, **self._settings(max_tokens, ignore_eos)}

    def _chat_body(self, messages: list[dict], max_tokens: int, ignore_eos: bool) -> dict:
        return {"messages": messages, **self._settings(max_tokens, ignore_eos)}

    def _settings(self, max_tokens: int, ignore_eos: bool) -> dict:
        return {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos, "stream": True,
                "stream_options": {"include_usage": True}}

    async def generate(self, index, request_id, prompt_token_ids, max_tokens, ignore_eos, request_timeout) -> HTTPRequestResult:
        res = HTTPRequestResult(index, request_id, len(prompt_token_ids))
        return await self._request(res, self._body(prompt_token_ids, max_tokens, ignore_eos), request_timeout)

    async def send_messages(self, index, request_id, messages: list[dict], max_tokens, ignore_eos, request_timeout) -> HTTPRequestResult:
        """One ``/v1/chat/completions`` request of these messages (a multi-turn history);
        the answer's text in ``text``. Its prompt length is the server's count."""
        return await self._request(HTTPRequestResult(index, request_id, 0), self._chat_body(messages, max_tokens, ignore_eos),
                                   request_timeout)

    async def _request(self, res: HTTPRequestResult, body: dict, request_timeout: float) -> HTTPRequestResult:
        request_id = res.request_id
        self._tasks[request_id] = asyncio.current_task()
        try:
            await asyncio.wait_for(self._stream(res, body), request_timeout)
        except TimeoutError:
            res.error = f"no full response within {request_timeout:g} s"
        except asyncio.CancelledError:
            res.error = res.error or "aborted"
            raise
        except (aiohttp.ClientError, ValueError, msgspec.DecodeError) as e:
            res.error = f"{type(e).__name__}: {e}"
        finally:
            self._tasks.pop(request_id, None)
        return res

    async def _stream(self, res: HTTPRequestResult, body: dict) -> None:
        res.start_s = last = time.perf_counter()
        async with self._session.post(self.base_url + self.endpoint, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                chunk = _decode(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return
                now = time.perf_counter()
                for choice in chunk.get("choices") or ():
                    text = choice.get("text") if not self.chat else (choice.get("delta") or {}).get("content")
                    if text:
                        if self.chat:
                            res.text += text
                        if res.ttft_s is None:
                            res.ttft_s = now - res.start_s
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                if chunk.get("usage"):
                    # NOTE: the server's counts: a chat prompt is the template's tokens, not the dataset's.
                    res.prompt_len = chunk["usage"]["prompt_tokens"]
                    res.num_output_tokens = chunk["usage"]["completion_tokens"]
                    # NOTE: None when the server does not say (vLLM and kvpool only with
                    # --enable-prompt-tokens-details): unknown, not 0.
                    details = chunk["usage"].get("prompt_tokens_details")
                    res.num_cached_tokens = details.get("cached_tokens") or 0 if details else None
        res.latency_s = time.perf_counter() - res.start_s
        res.success = res.finish_reason in SUCCESS_FINISH_REASONS
        if not res.success and res.error is None:
            res.error = f"finished with reason {res.finish_reason!r}"
