"""Records vLLM 0.32's own block hashes for tests/scheduler/core/test_vllm_hashing.py: run with the
vLLM venv, once with PYTHONHASHSEED unset and once with PYTHONHASHSEED=12345:

    .venv-vllm/bin/python tests/scheduler/core/data/record_vllm_block_hashes.py > tests/scheduler/core/data/vllm_block_hashes_unset.json
    PYTHONHASHSEED=12345 .venv-vllm/bin/python tests/scheduler/core/data/record_vllm_block_hashes.py > tests/scheduler/core/data/vllm_block_hashes_12345.json

vLLM's own functions, chained as its BlockPool does (the xxhash ones need xxhash in that venv)."""
import json
import os

import vllm.v1.core.kv_cache_utils as kcu
from vllm.utils.hashing import get_hash_fn_by_name

TOKENS = list(range(1000, 1012)) + [0, 2**31 - 1, 5, 6]
out = {}
for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    for salt in (None, "tenant-a"):
        parent = None
        hashes = []
        for i in range(0, 16, 4):
            extra = (("cache_salt", salt),) if (i == 0 and salt) else None
            parent = kcu.hash_block_tokens(fn, parent, TOKENS[i:i + 4], extra)
            hashes.append(parent.hex())
        out[f"{algo}/{salt}"] = {"none_hash": kcu.NONE_HASH.hex(), "hashes": hashes,
                                  "event": [kcu.maybe_convert_block_hash(bytes.fromhex(h)) for h in hashes]}
print(json.dumps({"seed": os.environ.get("PYTHONHASHSEED"), "tokens": TOKENS, "out": out}))
