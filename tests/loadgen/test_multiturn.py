"""The multi-turn workload (loadgen/multiturn.py): ShareGPT's questions per user in the
seeded order; every round resends the whole history (the shared system prompt, the user's
questions and the server's own answers, as streamed) to a stand-in chat server that
records what it gets; a round whose answer failed ends its conversation; through a real
``kvpool serve`` the resent history is a prefix-cache hit."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from kvtest.ports import free_port
from kvtest.serve import kvpool_serve

from loadgen.multiturn import Chats, send_chats, sharegpt_chats
from loadgen.openai_client import OpenAIClient

REPO = Path(__file__).resolve().parents[2]


def conversation(cid: str, turns: int) -> dict:
    conv = []
    for t in range(turns):
        conv += [{"from": "human", "value": f"{cid} question {t} " + "word " * 30}, {"from": "gpt", "value": f"{cid} reply {t}"}]
    return {"id": cid, "conversations": conv}


DATA = [conversation("a", 3), conversation("b", 1), conversation("c", 4), conversation("d", 2)]


def test_each_user_asks_one_conversations_questions_in_the_seeded_order():
    chats = sharegpt_chats(DATA, users=3, rounds=3, system_words=5, question_words=4, seed=7)
    shuffled = list(DATA)
    random.Random(7).shuffle(shuffled)
    long_enough = [c["id"] for c in shuffled if c["id"] in ("a", "c")]  # three human turns or more
    want = [[f"{long_enough[u % 2]} question {t} word" for t in range(3)] for u in range(3)]
    assert chats.questions == want and chats.num_requests == 9
    assert len(chats.system_prompt.split()) == 5
    with pytest.raises(ValueError, match="no conversation has 5 human turns"):
        sharegpt_chats(DATA, users=1, rounds=5, system_words=5, question_words=4, seed=0)


async def stand_in_server(port: int, seen: list[list[dict]], fail_on: str | None = None) -> web.AppRunner:
    """/health, /v1/models and a streamed /v1/chat/completions answering "answer N"."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body["messages"])
        if fail_on is not None and body["messages"][-1]["content"] == fail_on:
            return web.Response(status=500, text="boom")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in ({"choices": [{"delta": {"content": "answer "}}]}, {"choices": [{"delta": {"content": str(len(seen))}}]},
                      {"choices": [{"delta": {}, "finish_reason": "length"}]},
                      {"choices": [], "usage": {"prompt_tokens": len(json.dumps(body["messages"])), "completion_tokens": 2}}):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def run_chats(chats: Chats, fail_on: str | None = None):
    seen: list[list[dict]] = []

    async def go():
        port = free_port()
        server = await stand_in_server(port, seen, fail_on)
        client = OpenAIClient(f"http://127.0.0.1:{port}", "/v1/chat/completions", None, True, decode_prompts=False)
        try:
            await client.connect(10)
            return await send_chats(client, chats, 2, True, 30, 60, "t")
        finally:
            await client.close()
            await server.cleanup()

    return asyncio.run(go()), seen


def test_every_round_resends_the_history_with_the_servers_own_answers():
    chats = Chats("be brief", [["u0 q0", "u0 q1", "u0 q2"], ["u1 q0", "u1 q1", "u1 q2"]])
    outcome, seen = run_chats(chats)
    assert [r.success for r in outcome.results] == [True] * 6
    by_last = {m[-1]["content"]: m for m in seen}
    for u in range(2):
        history = [{"role": "system", "content": "be brief"}]
        for r in range(3):
            history.append({"role": "user", "content": f"u{u} q{r}"})
            assert by_last[f"u{u} q{r}"] == history  # all that came before, in order
            answer = outcome.results[u * 3 + r].text
            assert answer.startswith("answer ")
            history.append({"role": "assistant", "content": answer})
    # the server's counts: each round's prompt longer than the last
    assert all(outcome.results[i].prompt_len < outcome.results[i + 1].prompt_len for i in (0, 1, 3, 4))


def test_a_failed_round_ends_its_conversation_and_the_others_go_on():
    chats = Chats("s", [["u0 q0", "u0 q1", "u0 q2"], ["u1 q0", "u1 q1", "u1 q2"]])
    outcome, _ = run_chats(chats, fail_on="u0 q1")
    assert [r.success for r in outcome.results] == [True, False, False, True, True, True]
    assert "HTTP 500" in outcome.results[1].error and "not sent" in outcome.results[2].error


@pytest.mark.e2e
@pytest.mark.slow
def test_through_kvpool_serve_the_resent_history_is_a_prefix_cache_hit(tmp_path, tiny_checkpoint):
    data = tmp_path / "sg.json"
    data.write_text(json.dumps([conversation(c, 3) for c in "abcd"]))
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--kv-cache-memory", "32MiB") as served:
        proc = subprocess.run([sys.executable, "-m", "loadgen", "--base-url", served.base_url, "--dataset", "multiturn",
                               "--dataset-path", str(data), "--num-users", "3", "--num-rounds", "3", "--system-prompt-words", "60",
                               "--output-len", "8", "--result-json", str(tmp_path / "r.json")],
                              cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 9 and result["failed"] == 0
    assert "3 users x 3 rounds" in result["workload"] and "/v1/chat/completions" in result["workload"]
    # rounds 2 and 3 resend rounds 1-2 whole, the system prompt is shared: most prompt tokens hit
    assert result["prefix_cache_hit_rate"] > 0.5
