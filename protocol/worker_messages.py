"""Messages between the scheduler (ROUTER, worker port) and its workers (DEALER).

The contract (DESIGN.md): block ids are the only memory the scheduler knows; rows
are append-only; steps are consecutive from 0; full blocks are read-only; the
worker derives what it can, so a plan carries only what changed.

Requests are named on this wire by ``seq_id``, a small integer the scheduler gives
each request for its lifetime, not by the client's string id: a plan for a batch
that goes on unchanged is then a handful of bytes (rule 5).

All structs are ``array_like`` (encoded as msgpack arrays, tag first) with
``omit_defaults`` (trailing default fields are left out).
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from protocol.prompt_logprobs import PromptLogprobs
from protocol.sampling_params import SamplingParams
from protocol.structured_output import GrammarSpec, RowGrammar

_OPTS = dict(array_like=True, omit_defaults=True, gc=False, tag_field="t")


class RowSampling(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """How a row samples: its SamplingParams, and how many of its tokens are the prompt
    (penalties, min_tokens and seeded draws count the output after it)."""

    num_prompt_tokens: int
    params: SamplingParams
    # Structured outputs: the grammar its sampled tokens must follow (rank 0 masks
    # the logits with it), None for none. Its matcher is rebuilt from the row's output
    # tokens when the row is sent whole again (resumed).
    grammar: RowGrammar | None = None


class RequestRow(msgspec.Struct, **_OPTS, tag=0):
    """A request's whole row: sent once when the request starts (StepPlan.new_rows),
    and again when it resumes after preemption (StepPlan.resumed_rows) -- also after
    a worker was lost, when every running request resumes by recompute."""

    seq_id: int
    # Every token the request has so far: prompt, then any already-sampled output.
    token_ids: list[int]
    # The block table, in order; position p lives in block_ids[p // block_size].
    block_ids: list[int]
    # Tokens whose K/V are already in the cache (prefix-cache hits; a multiple of
    # block_size). The first scheduled token of this row is at this position.
    num_computed_tokens: int = 0
    # None: greedy, no logprobs (one byte on the wire).
    sampling: RowSampling | None = None
    # The tables of groups 1..N-1 (GroupRequestRow); NOTE: not a field here, so a one-group row
    # stays byte for byte what it was.
    group_block_ids: ClassVar[list[list[int]]] = []


class GroupRequestRow(RequestRow, tag=20):
    """A RequestRow of a hybrid model (several KV-cache groups): its fields (``block_ids``
    is group 0's table), then the tables of groups 1..N-1, in group order."""

    group_block_ids: list[list[int]] = []


class AppendedBlocks(msgspec.Struct, **_OPTS, tag=1):
    """Block ids appended to the end of a live row (rule 2: rows only grow), in its
    table of KV-cache group 0 (the only one of most models)."""

    seq_id: int
    block_ids: list[int]
    # NOTE: not a field: a one-group plan's appends stay byte for byte what they were.
    group: ClassVar[int] = 0


class GroupAppendedBlocks(msgspec.Struct, **_OPTS, tag=13):
    """Block ids appended to a live row's table in KV-cache ``group`` >= 1 (hybrid models)."""

    seq_id: int
    group: int
    block_ids: list[int]


class NulledBlocks(msgspec.Struct, **_OPTS, tag=14):
    """The one exception to rule 2 (DESIGN.md, hybrid groups): entries [0, num_blocks) of
    the row's table in a sliding-window ``group`` (any group, 0 included) now hold the
    null block 0. Their blocks fell wholly outside the window and the scheduler freed
    them; num_blocks only grows. Sent after the step's appends (StepPlan.appended)."""

    seq_id: int
    group: int
    num_blocks: int


# What a plan changes in live rows' tables, applied in order (StepPlan.appended). A one-group
# model's plans hold only AppendedBlocks; the other two are hybrid models' (several groups).
TableDelta = AppendedBlocks | GroupAppendedBlocks | NulledBlocks


class WorkerHello(msgspec.Struct, **_OPTS, tag=2):
    """First message of a worker: who it is and what memory it has."""

    rank: int
    world_size: int
    # KV blocks that fit this worker's memory budget (block 0 included).
    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_id: int
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    # A label for metrics and logs ("cpu", "cuda:0", ...).
    device: str = ""
    # The model's identity: its architecture and a hash of config.json and the weights'
    # index. A scheduler whose pool was built for another model refuses the worker.
    architecture: str = ""
    model_hash: str = ""
    # Every EOS id (config.json and generation_config.json; eos_token_id is the first).
    eos_token_ids: list[int] = []
    # The longest context the model serves (max_position_embeddings, or less).
    max_model_len: int = 0
    # Host-memory KV slots this worker preallocated for the offload tier
    # (--kv-offloading-size); 0: no host tier.
    num_host_blocks: int = 0
    # The KV-cache groups' windows, in group order (0: full attention); empty: one
    # full-attention group, every model before hybrid groups. num_blocks counts blocks
    # of protocol.kv_cache_spec.num_kv_tensors layers each.
    group_windows: list[int] = []
    # The external KV tier (--kv-offloading-backend disk or mooncake; "": none): its name, the
    # identity its objects are made for (a digest of the model, the KV dtype and layout and the
    # block size, protocol/external_kv.py), and the keys it holds now (a directory's listing;
    # a shared store is asked by the scheduler instead, so none here).
    external_tier: str = ""
    external_identity: str = ""
    external_keys: list[str] = []
    # P/D disaggregation (--kv-transfer-config): the "host:port" decode engines' workers read
    # this worker's lent blocks at ("": it lends none), and the identity of its KV (the
    # external tier's digest: a reader of another model or layout is refused).
    kv_transfer_address: str = ""
    kv_transfer_identity: str = ""
    # The KV cache as the worker allocated it: the torch dtype its tensors hold ("bfloat16";
    # "float8_e4m3fn" for --kv-cache-dtype fp8) and that element's bytes, and the bytes of one
    # block: K and V across every KV tensor of this rank (a tensor that layers of different
    # KV-cache groups share counted once). Read from the tensors, so the scheduler and the
    # launcher take them from here rather than derive them again ("" / 0: not reported).
    kv_cache_dtype: str = ""
    kv_cache_dtype_size: int = 0
    kv_block_bytes: int = 0
    # The weights' and activations' torch dtype ("bfloat16") and its element's bytes.
    dtype: str = ""
    dtype_size: int = 0


class WorkerReady(msgspec.Struct, **_OPTS, tag=3):
    """The scheduler's answer to WorkerHello: the pool size it chose and the limits
    the worker's block table must hold. next_step_id is the step_id of the next plan.
    The worker starts with no rows: a worker that handshakes again has lost them.

    NOTE: no resync (rows handed back whole to a returning worker, docs/architecture.md):
    the scheduler cannot tell that a returning worker's KV is the one it wrote, and the
    outcome of the step in flight at the loss is unknown."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    next_step_id: int = 0
    # The host tier the scheduler manages (at most the hello's num_host_blocks); 0: none.
    num_host_blocks: int = 0


class TierCopies(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A step's copies between the device pool and the host tier, as parallel lists:
    device block store_device_ids[i] into host slot store_host_ids[i] (all stores
    first), then host slot load_host_ids[i] into device block load_device_ids[i]."""

    store_device_ids: list[int] = []
    store_host_ids: list[int] = []
    load_host_ids: list[int] = []
    load_device_ids: list[int] = []


class ExternalKVOps(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A step's work for the external KV tier (disk, Mooncake Store), off the step path:
    device block save_block_ids[i], which this step computes, is saved under save_keys[i]
    (read once the step's forward ran, before the result goes back); each load reads its
    keys into its device blocks after the step ran, and the worker says how it went in an
    ``ExternalKVDone``. The scheduler computes no token of a loading request's blocks
    until then, and never frees them before."""

    save_block_ids: list[int] = []
    save_keys: list[str] = []
    # load_ids[i]: load i's id (the request's seq_id); its keys and device blocks, in order.
    load_ids: list[int] = []
    load_keys: list[list[str]] = []
    load_block_ids: list[list[int]] = []


class KVTransferOps(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A step's work for P/D disaggregation (protocol/kv_transfer_config.py), off the step path.

    A prefill engine *lends*: lend_ids[i] (a finished request's id) may now be read by a
    decode engine's worker, blocks lend_block_ids[i] (one list per KV-cache group, in table
    order; the scheduler frees none of them before the worker reports the read, or takes the
    lend back: ``unlend_ids``, applied before this step's forward, after which a read of
    them is refused).

    A decode engine *pulls*: pull i (id pull_ids[i], the request's seq_id) reads blocks
    pull_remote_block_ids[i] (one list per KV-cache group, each a run of that group's lent
    blocks) of request pull_request_ids[i] from the worker at pull_addresses[i]
    ("host:port") into device blocks pull_block_ids[i], in the same order (the groups' lists
    one after another); the worker says how it went in a ``KVTransferDone``. As with the
    external tier's loads, the scheduler computes no token of those blocks until then, and
    frees none of them before."""

    lend_ids: list[str] = []
    lend_block_ids: list[list[list[int]]] = []
    unlend_ids: list[str] = []
    pull_ids: list[int] = []
    pull_addresses: list[str] = []
    pull_request_ids: list[str] = []
    pull_remote_block_ids: list[list[list[int]]] = []
    pull_block_ids: list[list[int]] = []


class StepPlan(msgspec.Struct, **_OPTS, tag=4):
    """One step, for a model of one KV-cache group or several. Applied in this order
    (rule 3): drop finished and preempted rows, add new rows, replace resumed rows (a
    hybrid model's rows are GroupRequestRows, with every group's table), apply the table
    deltas in order (appends, then nulled sliding-window entries); then the offload tier's
    copies -- every store (device block -> host slot) first, then every load (host
    slot -> device block), so a device block stored and reused in the same step is
    saved before it is overwritten; then for the scheduled tokens write K/V into
    their slots, run attention and sample.

    Scheduled tokens: every live row decodes exactly one token this step unless
    ``num_scheduled_tokens`` names it (a prefill chunk, or 0 for a row left out of
    this step). A row whose computed tokens reach its token count samples one token.

    Speculative decoding: a row named in ``spec_token_ids`` has one token without K/V
    (its last) and is scheduled 1 + len(drafts) tokens: that token, then the drafts, at the
    positions after it. Its K/V are written for all of them and it samples at each: the
    drafts are verified in order and the first token that differs from its draft (or the
    token after the last draft) ends the row's tokens of the step (StepResult.extra_token_ids).
    Its computed tokens then count only the verified ones; the rejected drafts' slots are
    written again by later steps. Drafts are never in a row's token_ids until verified.
    """

    step_id: int
    num_scheduled_tokens: dict[int, int] = {}
    new_rows: list[RequestRow | GroupRequestRow] = []
    resumed_rows: list[RequestRow | GroupRequestRow] = []
    appended: list[TableDelta] = []
    finished_seq_ids: list[int] = []
    preempted_seq_ids: list[int] = []
    # The offload tier's copies of this step; None (one byte) when there are none.
    tier_copies: TierCopies | None = None
    # The external tier's saves and loads (ExternalKVOps); None (one byte, or nothing) when none.
    external: ExternalKVOps | None = None
    # P/D disaggregation's lends and pulls (KVTransferOps); None when none.
    kv_transfer: KVTransferOps | None = None
    # A step with drafts is a SpecStepPlan: seq_id -> the draft tokens scheduled after the
    # row's last token. NOTE: not a field here: an array-like struct encodes every field, and
    # a plan without drafts stays byte for byte what it was. Read only.
    spec_token_ids: ClassVar[dict[int, list[int]]] = {}


class SpecStepPlan(StepPlan, tag=16):
    """A StepPlan with drafts to verify (speculative decoding): the same fields, then the drafts."""

    spec_token_ids: dict[int, list[int]] = {}


class SampledLogprobs(msgspec.Struct, **_OPTS, tag=9):
    """Logprobs of one sampled token, for a row whose SamplingParams asked for them."""

    seq_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class StepResult(msgspec.Struct, **_OPTS, tag=5):
    """The worker's answer to a StepPlan: the token sampled for every row that
    finished its prefill or decoded this step (two parallel lists); a row that verified
    drafts may have more (``extra_token_ids``)."""

    step_id: int
    seq_ids: list[int] = []
    sampled_token_ids: list[int] = []
    # Seconds the worker spent executing the step (apply + forward + sample).
    execute_time_s: float = 0.0
    # Only rows that asked for logprobs, in seq_ids order.
    logprobs: list[SampledLogprobs] = []
    # seq_id -> what this step's tokens scored of its prompt (rows that asked for prompt
    # logprobs only), and an entry, maybe empty, for such a row sampling its first token:
    # the scheduler joins them (scheduler.sched.prompt_logprobs).
    prompt_logprobs: dict[int, PromptLogprobs] = {}
    # seq_id -> the tokens a row gained after its first this step, for a row whose first
    # draft was accepted (then its first token is that draft): the further accepted
    # drafts, then the token sampled after the last accepted one.
    # ``logprobs`` then holds one entry per token of such a row, in order.
    extra_token_ids: dict[int, list[int]] = {}


class WorkerError(msgspec.Struct, **_OPTS, tag=6):
    """A plan (or frame) the worker refused; its state is as it was before."""

    message: str
    step_id: int = -1


class Heartbeat(msgspec.Struct, **_OPTS, tag=7):
    """Liveness, both ways, on an idle link."""

    sent_at: float = 0.0


class Shutdown(msgspec.Struct, **_OPTS, tag=8):
    """The scheduler tells a worker to exit: cleanly (0) once ready; before
    WorkerReady it is a refusal, and the worker exits 4 so a supervisor retries."""

    reason: str = ""


class WorkerExit(msgspec.Struct, **_OPTS, tag=10):
    """A worker stopping on purpose (SIGTERM): its rows go with it, but nothing failed."""

    reason: str = ""


class CompileGrammars(msgspec.Struct, **_OPTS, tag=11):
    """Start compiling these requests' grammars (parallel lists), off the step path:
    sent when the requests arrive, long before their rows. The worker answers with
    GrammarsReady as each compile ends; it keeps what it compiled, by spec, for the rows."""

    seq_ids: list[int]
    grammars: list[GrammarSpec]


class GrammarsReady(msgspec.Struct, **_OPTS, tag=12):
    """Grammars compiled since the last GrammarsReady: their requests may be scheduled
    (vLLM's WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR ends). ``failed_seq_ids[i]`` failed with ``errors[i]``."""

    seq_ids: list[int] = []
    failed_seq_ids: list[int] = []
    errors: list[str] = []


class ExternalKVDone(msgspec.Struct, **_OPTS, tag=18):
    """The external tier's news since the last one (sent off the step path, as each load
    ends): load id -> how many of its blocks, from the first, were read and checked (the
    rest are computed again); and keys the tier no longer holds (evicted to stay within its
    bound, a save that failed, an object found corrupt or foreign)."""

    loaded: dict[int, int] = {}
    removed_keys: list[str] = []


class KVTransferDone(msgspec.Struct, **_OPTS, tag=19):
    """P/D disaggregation's news since the last one (sent off the step path): pull id ->
    how many of its blocks, from the first, were read and written (the rest are computed
    again, or the request fails, by the failure policy); and the ids of lent requests a
    decode engine has read (their blocks may be freed)."""

    pulled: dict[int, int] = {}
    sent: list[str] = []


WorkerToScheduler = WorkerHello | StepResult | WorkerError | Heartbeat | WorkerExit | GrammarsReady | ExternalKVDone | KVTransferDone
SchedulerToWorker = WorkerReady | StepPlan | SpecStepPlan | Heartbeat | Shutdown | CompileGrammars
