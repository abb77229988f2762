"""The sampler's draw at temperature > 0 (``python -m bench sampler``): 8 rows (a batch at
concurrency 8) of a 32,000-token vocabulary (Llama 2's) and of a 128,256-token one (Llama
3's), the softmax and the draw of ``worker.sample.sampler``, against the exponential race the
sampler ran before (vLLM's torch path: ``argmax(probs / q)``, q ~ Exp(1) drawn for every
entry) over the same logits in the same run, one torch thread, measured in alternating
rounds. Target: faster than the race at both sizes.
"""

from __future__ import annotations

import torch

from bench.table import Row
from bench.worker_bench import best_interleaved_us, warm_up
from worker.sample.sampler import draw

ROWS = 8
VOCABS = (32_000, 128_256)


def race(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    return probs.div(torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)


def inverse(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return draw(logits.softmax(dim=-1, dtype=torch.float32), [], generator)


def rows() -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for vocab in VOCABS:
            logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(0)) * 2.0
            gen = torch.Generator().manual_seed(1)
            fns = (lambda logits=logits, gen=gen: inverse(logits, gen), lambda logits=logits, gen=gen: race(logits, gen))
            warm_up(*fns)
            ours, theirs = best_interleaved_us(*fns, rounds=5)
            out += [
                Row(f"sampler: {ROWS} rows x {vocab:,} vocab, exponential race (1 thread)", theirs / 1e3, "ms"),
                Row(f"sampler: {ROWS} rows x {vocab:,} vocab, softmax + inverse-CDF draw", ours / 1e3, "ms",
                    "< the race", ours < theirs),
            ]
    finally:
        torch.set_num_threads(threads)
    return out


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
