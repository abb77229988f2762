"""The frames between a decode engine's worker and a prefill engine's worker (P/D disaggregation).

The prefill worker binds a ZMQ ROUTER (protocol/kv_transfer_config.py's side channel);
a decode worker's DEALER sends a `PullRequest` (one frame: the blocks it reads, one run
of the lent blocks per KV-cache group) and gets one `PullReply` frame, then, when the
reply is ``ok``, one frame of ``num_blocks * block_bytes`` bytes: block by block, in the
order asked (the groups' runs one after another), each block every layer's K then V, as the KV tensors
hold them (the external tier's object payload, worker/kv/kv_block_bytes.py). The identity
is protocol/external_kv.py's digest of model, KV dtype, layout and block size: a worker
of another model or layout is refused, never given bytes it would misread.
"""

from __future__ import annotations

import msgspec

# Why a pull was refused (PullReply.error): the lend is unknown (never lent, read already,
# or taken back after its lease), the blocks are not the lent ones, the identity differs.
REFUSALS = ("unknown", "blocks", "identity", "malformed")


class PullRequest(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    block_ids: list[list[int]]  # one list per KV-cache group, as lent
    identity: str


class PullReply(msgspec.Struct, array_like=True, frozen=True):
    ok: bool
    num_blocks: int = 0
    block_bytes: int = 0
    # One of REFUSALS when not ok, and a line for the log.
    error: str = ""
    detail: str = ""
