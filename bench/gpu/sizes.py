"""How much each step of ``python -m bench.gpu`` does: the full call on CUDA, and the dry
run on a CPU (small enough for two cores in a minute or two)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    prompts: int  # greedy prompts per served configuration
    max_tokens: int  # tokens each answer decodes
    floor_rows: tuple[int, ...]  # decode rows the step is timed at
    floor_context: int  # tokens of context each row attends
    floor_steps: int  # timed decode steps (the median kept)
    copy_bytes: int  # the copy that measures the bandwidth
    floor_model: str  # "llama50m" or "tiny": the generated checkpoint the step is timed on


CUDA_FULL = Sizes(prompts=16, max_tokens=16, floor_rows=(1, 64, 256), floor_context=512, floor_steps=20, copy_bytes=1 << 30,
                  floor_model="llama50m")
CPU_DRY_RUN = Sizes(prompts=4, max_tokens=6, floor_rows=(1, 4, 16), floor_context=64, floor_steps=3, copy_bytes=256 << 20,
                    floor_model="tiny")
