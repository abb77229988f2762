"""``kv_transfer_params.remote_block_ids`` as parsed (protocol/kv_transfer_params.py): vLLM
0.32's one list per KV-cache group kept as it came, a flat list (older vLLMs', one group)
made one group's; anything else a ValueError naming the key, the API's 400."""

from __future__ import annotations

import pytest

from protocol.kv_transfer_params import parse_kv_transfer_params

SOURCE = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "10.0.0.7", "remote_port": 5600}


@pytest.mark.parametrize(("given", "groups"), [
    ([3, 5, 7], [[3, 5, 7]]),  # older vLLMs': one group
    ([[3, 5, 7]], [[3, 5, 7]]),  # vLLM 0.32's, one group
    ([[3, 5, 7, 9], [8, 10]], [[3, 5, 7, 9], [8, 10]]),  # a hybrid model's: full attention, a sliding tail
    ([[3, 5], []], [[3, 5], []]),  # a group that lends nothing
    ([], [[]]),  # one group, no block
], ids=["flat", "one-group", "hybrid", "empty-group", "empty"])
def test_remote_block_ids_are_one_list_per_group(given, groups):
    assert parse_kv_transfer_params({**SOURCE, "remote_block_ids": given}).remote_block_ids == groups


@pytest.mark.parametrize("given", [
    [1, -2], [1, [2]], [[1], 2], [[1], [-1]], [[1, True]], [True], [[1], [2.0]], [[[1]]], "1,2", {"0": [1]}, 7, [[1], None],
    [2**31],
], ids=["negative", "mixed", "mixed-tail", "group-negative", "group-bool", "bool", "float", "deeper", "string", "object", "int",
        "null-group", "too-big"])
def test_anything_else_is_a_value_error_naming_the_key(given):
    with pytest.raises(ValueError, match=r"kv_transfer_params\.remote_block_ids must be a list of block ids \(integers >= 0\), "
                                         r"or one such list per KV-cache group, got"):
        parse_kv_transfer_params({**SOURCE, "remote_block_ids": given})


def test_a_decode_request_still_needs_them():
    with pytest.raises(ValueError, match=r"kv_transfer_params\.remote_block_ids is required with do_remote_prefill"):
        parse_kv_transfer_params(SOURCE)
