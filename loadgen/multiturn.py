"""Multi-turn chats, as LMCache's multi-round QA benchmark drives a server: ``users``
conversations at once, each ``rounds`` questions long, every request resending the whole
history (a system prompt shared by all users, the user's earlier questions and the
model's own answers), so each round's prompt begins with everything its user sent
before. That is the prefix reuse real chat traffic has.

The questions are ShareGPT's: user u asks the human turns of one conversation of the
shuffled file (its first ``rounds``, cut to ``question_words`` words each), the shared
system prompt is ``system_words`` words of another conversation's text. Requests go to
``/v1/chat/completions`` (the server applies the model's chat template); a user's next
round leaves when its previous answer is in.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from loadgen.openai_client import HTTPRequestResult, OpenAIClient
from loadgen.progress import Progress
from loadgen.runner import RunOutcome


@dataclass(frozen=True)
class Chats:
    system_prompt: str
    questions: list[list[str]]  # per user, per round

    @property
    def num_requests(self) -> int:
        return sum(len(q) for q in self.questions)


def sharegpt_chats(conversations: list[dict], users: int, rounds: int, system_words: int, question_words: int, seed: int) -> Chats:
    """Questions from the human turns of conversations with ``rounds`` of them or more (in
    the seeded shuffle's order; fewer such conversations than users are reused in turn)."""
    rng = random.Random(seed)
    data = [c for c in conversations if isinstance(c, dict) and isinstance(c.get("conversations"), list)]
    rng.shuffle(data)
    turns = [[t["value"] for t in c["conversations"] if t.get("from") == "human" and t.get("value")] for c in data]
    long_enough = [t for t in turns if len(t) >= rounds]
    if not long_enough:
        raise ValueError(f"no conversation has {rounds} human turns")
    text = " ".join(" ".join(c.get("value", "") for c in d["conversations"]) for d in data[:50]).split()
    system = " ".join(text[:system_words])
    questions = [[" ".join(q.split()[:question_words]) for q in long_enough[u % len(long_enough)][:rounds]] for u in range(users)]
    return Chats(system, questions)


async def send_chats(client: OpenAIClient, chats: Chats, max_tokens: int, ignore_eos: bool, request_timeout: float, timeout: float | None,
                     prefix: str, progress: Progress | None = None) -> RunOutcome:
    """Every user's rounds, users side by side; results in (user, round) order."""
    rounds = len(chats.questions[0]) if chats.questions else 0
    results: list[HTTPRequestResult | None] = [None] * chats.num_requests
    t0 = time.perf_counter()

    async def user(u: int) -> None:
        history = [{"role": "system", "content": chats.system_prompt}]
        for r, question in enumerate(chats.questions[u]):
            i = u * rounds + r
            history.append({"role": "user", "content": question})
            res = await client.send_messages(i, f"{prefix}-{u}-{r}", history, max_tokens, ignore_eos, request_timeout)
            results[i] = res
            if progress is not None:
                progress.update(res.success)
            if not res.success:
                return  # NOTE: a conversation whose answer did not come cannot go on
            history.append({"role": "assistant", "content": res.text})

    tasks = [asyncio.create_task(user(u)) for u in range(len(chats.questions))]
    timed_out = False
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        timed_out = bool(pending)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()
    final = [r if r is not None else HTTPRequestResult(i, f"{prefix}-{i // max(rounds, 1)}-{i % max(rounds, 1)}", 0,
                                                       error="not sent: an earlier round failed or the run timed out")
             for i, r in enumerate(results)]
    return RunOutcome(final, time.perf_counter() - t0, timed_out=timed_out)
