"""An in-process fake worker that replays StepPlans onto its own model of the block
tables and of the KV slots, and fails on any breach of the contract (DESIGN.md):

* a step gap or repeat;
* a row changed other than by append outside a resume (a new row for a live
  seq_id, a resumed row that was never preempted, appends to unknown rows);
* a block id outside the cache, or the null block in a row;
* a KV slot written twice since its block was handed out (full blocks are final:
  a block shared by several rows is read by all and written by none);
* a token that would read a KV slot that does not hold exactly its own prefix
  (never written, or overwritten by another sequence): the real worker would
  compute wrong attention.

Each slot remembers *which prefix* wrote it (a rolling hash of the tokens up to
that position), so a reader can tell its own data from anyone else's.

With ``num_host_blocks`` it also models the offload tier: a plan's tier copies run
after its row deltas, every store (device block -> host slot) first, then every
load (host slot -> device block), then the writes; a copy moves the prefix keys
of the whole block, so a load of the wrong data is caught by the reads.

Sampling is a deterministic function of a row's tokens, so a workload's outputs
do not depend on scheduling: runs with caching on/off, small pools or small
budgets must produce identical outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.worker_messages import AppendedBlocks, RequestRow, StepPlan, StepResult, TierCopies


class ContractViolation(AssertionError):
    pass


def fake_sample(token_ids: list[int], vocab_size: int) -> int:
    h = 0
    for t in token_ids[-4:]:
        h = (h * 1_000_003 + t) & 0xFFFFFFFF
    h = (h ^ (len(token_ids) * 2_654_435_761)) & 0xFFFFFFFF
    return h % vocab_size


@dataclass
class _Row:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    prefix_keys: list[int] = field(default_factory=list)

    def key(self, pos: int) -> int:
        keys = self.prefix_keys
        while len(keys) <= pos:
            prev = keys[-1] if keys else 0x9E3779B9
            keys.append(hash((prev, self.token_ids[len(keys)])))
        return keys[pos]


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int = 512, check_reads: bool = True, num_host_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        # (host slot, offset) -> prefix key copied there.
        self.host_slots: dict[tuple[int, int], int] = {}
        self.num_blocks_stored = self.num_blocks_loaded = 0
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.check_reads = check_reads
        self.rows: dict[int, _Row] = {}
        self.preempted: set[int] = set()
        # (block_id, offset) -> prefix key written there.
        self.slots: dict[tuple[int, int], int] = {}
        self.expected_step = 0
        self.num_tokens_written = 0

    def _check_row(self, row: RequestRow, what: str) -> None:
        for b in row.block_ids:
            if not 0 < b < self.num_blocks:
                raise ContractViolation(f"{what} row {row.seq_id}: block id {b} outside 1..{self.num_blocks - 1}")
        if len(set(row.block_ids)) != len(row.block_ids):
            raise ContractViolation(f"{what} row {row.seq_id}: a block id twice in one row")
        # NOTE: a decode engine's row whose prompt was pulled whole starts at its last token, anywhere in a block.
        if row.num_computed_tokens > len(row.token_ids):
            raise ContractViolation(f"{what} row {row.seq_id}: bad num_computed_tokens {row.num_computed_tokens}")

    def _fresh(self, block_ids) -> None:
        # A freshly allocated block: whatever it held is forgotten (and must not be read).
        for b in block_ids:
            for off in range(self.block_size):
                self.slots.pop((b, off), None)

    def _check_copies(self, copies: TierCopies) -> None:
        if not self.num_host_blocks:
            raise ContractViolation("tier copies in a plan, but this worker has no host tier")
        if len(copies.store_device_ids) != len(copies.store_host_ids) or len(copies.load_host_ids) != len(copies.load_device_ids):
            raise ContractViolation("tier copies: lists of different lengths")
        for d in copies.store_device_ids + copies.load_device_ids:
            if not 0 < d < self.num_blocks:
                raise ContractViolation(f"tier copy of device block {d}, outside 1..{self.num_blocks - 1}")
        for h in copies.store_host_ids + copies.load_host_ids:
            if not 0 <= h < self.num_host_blocks:
                raise ContractViolation(f"tier copy of host slot {h}, outside 0..{self.num_host_blocks - 1}")
        if len(set(copies.store_host_ids)) != len(copies.store_host_ids) or len(set(copies.load_device_ids)) != len(copies.load_device_ids):
            raise ContractViolation("tier copies: one host slot stored twice, or one device block loaded twice, in a step")

    def _copy_block(self, src: dict, src_block: int, dst: dict, dst_block: int) -> None:
        for off in range(self.block_size):
            key = src.get((src_block, off))
            if key is None:
                dst.pop((dst_block, off), None)
            else:
                dst[(dst_block, off)] = key

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.step_id != self.expected_step:
            raise ContractViolation(f"step {plan.step_id}, expected {self.expected_step}")
        self.expected_step += 1
        bs = self.block_size
        for seq_id in plan.finished_seq_ids:
            if self.rows.pop(seq_id, None) is None:
                raise ContractViolation(f"finished row {seq_id} is not live")
        for seq_id in plan.preempted_seq_ids:
            if self.rows.pop(seq_id, None) is None:
                raise ContractViolation(f"preempted row {seq_id} is not live")
            self.preempted.add(seq_id)
        fresh: set[int] = set()
        # Blocks handed out this step: forgotten after the stores (which may read them).
        fresh_blocks: list[int] = []
        for row in plan.new_rows:
            if row.seq_id in self.rows or row.seq_id in self.preempted:
                raise ContractViolation(f"new row {row.seq_id} already known: rows are sent whole only once")
            self._check_row(row, "new")
            self.rows[row.seq_id] = _Row(list(row.token_ids), list(row.block_ids), row.num_computed_tokens)
            fresh_blocks.extend(row.block_ids[-(-row.num_computed_tokens // bs) :])
            fresh.add(row.seq_id)
        for row in plan.resumed_rows:
            if row.seq_id not in self.preempted or row.seq_id in self.rows:
                raise ContractViolation(f"resumed row {row.seq_id} was not preempted")
            self.preempted.discard(row.seq_id)
            self._check_row(row, "resumed")
            self.rows[row.seq_id] = _Row(list(row.token_ids), list(row.block_ids), row.num_computed_tokens)
            fresh_blocks.extend(row.block_ids[-(-row.num_computed_tokens // bs) :])
            fresh.add(row.seq_id)
        for app in plan.appended:
            if type(app) is not AppendedBlocks:
                continue  # a hybrid model's other groups and nulled entries: kvtest.group_tables checks those
            r = self.rows.get(app.seq_id)
            if r is None or app.seq_id in fresh:
                raise ContractViolation(f"append to row {app.seq_id}, which is not a live row from an earlier step")
            for b in app.block_ids:
                if not 0 < b < self.num_blocks or b in r.block_ids:
                    raise ContractViolation(f"append to row {app.seq_id}: bad block id {b}")
            r.block_ids.extend(app.block_ids)
            fresh_blocks.extend(app.block_ids)
        for seq_id in plan.num_scheduled_tokens:
            if seq_id not in self.rows:
                raise ContractViolation(f"tokens scheduled for unknown row {seq_id}")
        copies = plan.tier_copies
        if copies is not None:
            self._check_copies(copies)
            for d, h in zip(copies.store_device_ids, copies.store_host_ids, strict=True):
                self._copy_block(self.slots, d, self.host_slots, h)
            self.num_blocks_stored += len(copies.store_device_ids)
        self._fresh(fresh_blocks)
        if copies is not None:
            for h, d in zip(copies.load_host_ids, copies.load_device_ids, strict=True):
                self._copy_block(self.host_slots, h, self.slots, d)
            self.num_blocks_loaded += len(copies.load_host_ids)

        owners: dict[int, int] = {}
        for r in self.rows.values():
            for b in r.block_ids:
                owners[b] = owners.get(b, 0) + 1

        # Writes first (all rows), then reads: the worker writes a layer's K/V for the
        # whole batch before attention, so a row may read what another wrote this step.
        work: list[tuple[int, _Row, int, int]] = []
        for seq_id, r in self.rows.items():
            n = plan.num_scheduled_tokens.get(seq_id, 1)
            if n == 0:
                continue
            start = r.num_computed
            if start + n > len(r.token_ids):
                raise ContractViolation(f"row {seq_id}: {n} tokens scheduled but only {len(r.token_ids) - start} to compute")
            if start + n > len(r.block_ids) * bs:
                raise ContractViolation(f"row {seq_id}: {start + n} tokens but blocks for {len(r.block_ids) * bs}")
            work.append((seq_id, r, start, n))
        for seq_id, r, start, n in work:
            for pos in range(start, start + n):
                slot = (r.block_ids[pos // bs], pos % bs)
                if slot in self.slots:
                    shared = " (shared)" if owners[slot[0]] > 1 else ""
                    raise ContractViolation(f"row {seq_id} writes position {pos} again into full block {slot[0]}{shared}")
                self.slots[slot] = r.key(pos)
                self.num_tokens_written += 1
        seq_ids, sampled = [], []
        for seq_id, r, start, n in work:
            if self.check_reads:
                last = start + n - 1
                for pos in range(last + 1):
                    slot = (r.block_ids[pos // bs], pos % bs)
                    if self.slots.get(slot) != r.key(pos):
                        raise ContractViolation(f"row {seq_id} reads position {pos} from block {slot[0]}: not its KV")
            r.num_computed = start + n
            if r.num_computed == len(r.token_ids):
                token = fake_sample(r.token_ids, self.vocab_size)
                r.token_ids.append(token)
                seq_ids.append(seq_id)
                sampled.append(token)
        return StepResult(plan.step_id, seq_ids, sampled)
