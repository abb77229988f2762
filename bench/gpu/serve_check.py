"""Greedy through a live ``kvpool serve`` against transformers' own greedy decoding of the
same checkpoint on the same device: token-id prompts to ``/v1/completions`` (temperature
0, ``ignore_eos``, ``return_token_ids``), every answer's ids compared with a plain
argmax loop over transformers' full forward, in float32 (no TF32: torch's default).
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from bench.compare.servers import Server, free_port, scrape_page

NAME = "checked"


@dataclass(frozen=True)
class ServeResult:
    label: str
    prompts: int
    equal: int  # answers equal to transformers' token for token
    first_diff: list[int]  # per prompt, the first position that differs (-1: none)

    @property
    def ok(self) -> bool:
        return self.equal == self.prompts


def prompts_for(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` token-id prompts of 8 to 120 tokens (ids 2.., past the tiny vocabulary's
    special tokens), every other one after a shared 48-token prefix (prefix-cache hits)."""
    gen = torch.Generator().manual_seed(seed)
    top = min(vocab_size, 32000)
    shared = torch.randint(2, top, (48,), generator=gen).tolist()
    out = []
    for i in range(count):
        n = int(torch.randint(8, 72, (1,), generator=gen))
        tail = torch.randint(2, top, (n,), generator=gen).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


def tier_prompts(vocab_size: int, count: int, seed: int = 1) -> list[list[int]]:
    """For a pool of ``TIER_POOL_BLOCKS``: prompts of 100 tokens, every third after the first
    repeating its first 96, the two between them long enough to push its blocks out of the
    pool (so a repeat's prefix can come back only from the host tier)."""
    gen = torch.Generator().manual_seed(seed)
    top = min(vocab_size, 32000)
    first = torch.randint(2, top, (100,), generator=gen).tolist()
    out = [first]
    for i in range(1, count):
        fresh = torch.randint(2, top, (100,), generator=gen).tolist()
        out.append(first[:96] + fresh[:4] if i % 3 == 0 else fresh)
    return out


TIER_POOL_BLOCKS = 10  # of 16 tokens: one prompt of 100 and its answer, not two


class Reference:
    """transformers' model of a checkpoint on a device, float32: its greedy answers and
    the rank it gives each token of another answer."""

    def __init__(self, model_dir: Path, device: torch.device):
        self.device = device
        # NOTE: a GGUF's folder (``kvpool serve FILE.gguf``'s) holds the file, which transformers reads itself.
        gguf = sorted(model_dir.glob("*.gguf")) if not any(model_dir.glob("*.safetensors")) else []
        kwargs = {"gguf_file": gguf[0].name} if gguf else {}
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs).to(device).eval()

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Each prompt's greedy continuation, one full forward per token."""
        answers = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p], device=self.device)
                out: list[int] = []
                for _ in range(max_tokens):
                    nxt = int(self.model(ids).logits[0, -1].argmax())
                    out.append(nxt)
                    ids = torch.cat([ids, torch.tensor([[nxt]], device=self.device)], dim=1)
                answers.append(out)
        return answers

    def worst_rank(self, prompts: list[list[int]], answers: list[list[int]]) -> int:
        """The largest rank (0: the argmax) the reference gives any answer's token, each
        token after its own answer's earlier ones (teacher forcing)."""
        worst = 0
        with torch.inference_mode():
            for p, a in zip(prompts, answers, strict=True):
                ids = torch.tensor([p + a], device=self.device)
                logits = self.model(ids).logits[0, len(p) - 1 : len(p) + len(a) - 1]  # (len(a), V)
                chosen = logits.gather(1, torch.tensor(a, device=self.device)[:, None])
                worst = max(worst, int((logits > chosen).sum(1).max()))
        return worst


def serve_greedy(model_dir: Path, device: str, flags: list[str], prompts: list[list[int]], max_tokens: int, log: Path,
                 ready_timeout_s: float = 300.0) -> tuple[list[list[int]], str]:
    """The answers of a ``kvpool serve`` started with ``flags``, one request after another
    (later prompts hit the earlier ones' cached prefix), and its /metrics page after them."""
    port = free_port()
    cmd = [sys.executable, "-m", "frontend.serve.cli", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", NAME, "--device", device, "--log-dir", str(log.parent / (log.stem + "-logs")), *flags]
    answers = []
    with Server("kvpool", cmd, {}, log, port) as server:
        server.wait_ready(ready_timeout_s)
        for p in prompts:
            body = {"model": NAME, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answers.append(json.loads(r.read())["choices"][0]["token_ids"])
        metrics = scrape_page(server.url)
    return answers, metrics


def compare(label: str, got: list[list[int]], want: list[list[int]]) -> ServeResult:
    diffs = [next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), -1 if len(g) == len(w) else min(len(g), len(w)))
             for g, w in zip(got, want, strict=True)]
    return ServeResult(label, len(want), sum(d == -1 for d in diffs), diffs)


def counter(page: str, name: str) -> float:
    """A counter of a /metrics page, summed over its label sets (0 when absent)."""
    return sum(s.value for fam in text_string_to_metric_families(page) if fam.name == name
               for s in fam.samples if s.name in (name, name + "_total"))
