"""A suffix tree of bounded depth over token sequences, as Arctic Inference's ``SuffixTree``
(the tree behind vLLM's suffix decoding), written afresh in Python.

The tree holds every substring of at most ``max_depth`` tokens of its sequences; a node's
``count`` is how many times its path occurs in them (the root's: how many tokens there are).
Paths are compressed: a node stands for a run of ``length`` tokens read from one sequence
(``ref``, from ``ref_idx``), so the tree has O(tokens) nodes. Each sequence keeps the ends of
its last ``max_depth`` suffixes ("active nodes"), so appending a token costs O(max_depth)
steps: the tree grows with a request, never rebuilt.

Drafting (`speculate`) matches each suffix of the context, and from its node follows the
first (most frequent) child again and again while the path's probability (the product of
child count / parent count) stays at or above ``min_token_prob``; the draft of highest score
(the sum of its tokens' probabilities) wins, the longer match on a tie. The probabilities are
float32 in Arctic: here each step is rounded to float32 (`f32`), so scores and ties agree.
"""

from __future__ import annotations

import struct
from collections import deque

from scheduler.spec.suffix_node import Node, decrement_count, increment_count, insert_after, new_group, replace_in_siblings, unlink

_F32 = struct.Struct("<f")


def f32(x: float) -> float:
    """``x`` rounded to float32. NOTE: a double computed from float32 operands and rounded so is
    the float32 result of +, * and / (double has more than twice float32's precision)."""
    return _F32.unpack(_F32.pack(x))[0]


class SuffixTree:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = Node(0, 0, 0, None, -1, None)
        self.seqs: dict[int, list[int]] = {}  # seq_id -> its tokens
        self.active: dict[int, deque[Node]] = {}  # seq_id -> where its last max_depth suffixes end

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new one if unknown)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            seq = self.seqs[seq_id] = []
            self.active[seq_id] = deque()
        active = self.active[seq_id]
        root, max_depth = self.root, self.max_depth
        for token in tokens:
            active.append(root)
            root.endpoints[seq_id] = len(seq)
            root.count += 1
            if len(active) > max_depth:
                active.popleft()
            seq.append(token)
            for i, node in enumerate(active):
                if node.count == 1 and node is not root:  # NOTE: the common case, inline: a leaf of this suffix alone grows
                    node.length += 1
                    node.endpoints[seq_id] += 1
                else:
                    active[i] = self._extend_suffix(node, token, seq_id, seq)

    def _extend_suffix(self, node: Node, token: int, seq_id: int, seq: list[int]) -> Node:
        """One suffix of ``seq``, ending at ``node``, grows by its new last ``token``: where it ends now."""
        seq_len = len(seq)
        child = node.children.get(token)
        if child is None:  # NOTE: node is the root or holds other suffixes (a leaf of this one alone grew in extend)
            new = Node(1, token, 1, seq, seq_len - 1, node)
            new.endpoints[seq_id] = seq_len
            node.children[token] = new
            del node.endpoints[seq_id]
            if node.tail_child is None:
                node.head_child = node.tail_child = new
                new.group = new_group(new)
            else:
                insert_after(new, node.tail_child)
            return new
        if node.count == child.count + 1 and node is not self.root:
            # Every other path through node goes on to child: node and child close up.
            return self._close_up(node, child, token, seq_id, seq)
        del node.endpoints[seq_id]
        if child.length == 1:
            child.endpoints[seq_id] = seq_len
            increment_count(child)
            return child
        # The suffix enters a longer child: split its first token off.
        new = Node(child.count, token, 1, seq, seq_len - 1, node)
        replace_in_siblings(child, new)
        node.children[token] = new
        child.length -= 1
        child.ref_idx += 1
        child.token = child.ref[child.ref_idx]
        child.parent = new
        new.children[child.token] = child
        new.head_child = new.tail_child = child
        child.group = new_group(child)
        new.endpoints[seq_id] = seq_len
        increment_count(new)
        return new

    def _close_up(self, node: Node, child: Node, token: int, seq_id: int, seq: list[int]) -> Node:
        """The suffix ends at ``node``, whose only child starts with ``token`` and is passed by every other path."""
        seq_len = len(seq)
        if child.length == 1:  # the child takes node's place, one token longer
            child.count += 1
            child.token, child.length = node.token, node.length + 1
            child.ref, child.ref_idx = seq, seq_len - child.length
            child.endpoints[seq_id] = seq_len
            child.parent = node.parent
            replace_in_siblings(node, child)
            node.parent.children[child.token] = child
            return child
        # node takes the child's first token
        node.length += 1
        node.endpoints[seq_id] += 1
        node.ref, node.ref_idx = seq, seq_len - node.length
        child.length -= 1
        child.ref_idx += 1
        child.token = child.ref[child.ref_idx]
        if child.token != token:
            del node.children[token]
            node.children[child.token] = child
        return node

    def remove(self, seq_id: int) -> None:
        """Take sequence ``seq_id`` out: each of its suffixes' counts, nodes it alone held, and its tokens."""
        seq = self.seqs[seq_id]
        for start in range(len(seq)):
            self._remove_suffix(seq, start, seq_id)
        del self.seqs[seq_id], self.active[seq_id]

    def _remove_suffix(self, seq: list[int], start: int, seq_id: int) -> None:
        node = self.root
        node.count -= 1
        path: list[Node] = []
        idx = start
        while idx < len(seq):
            token = seq[idx]
            child = node.children.get(token)
            if child is None:
                break
            if child.count == 1:  # this suffix alone held it and all below
                unlink(child)
                del node.children[token]
                break
            decrement_count(child)
            child.endpoints.pop(seq_id, None)
            idx += child.length
            node = child
            path.append(node)
        if node is not self.root and len(node.children) == 1:
            child = next(iter(node.children.values()))
            if child.count == node.count:  # node and its child close up
                child.token = node.token
                child.length += node.length
                child.ref_idx -= node.length
                child.parent = node.parent
                replace_in_siblings(node, child)
                node.parent.children[child.token] = child
                path[-1] = node = child
        self._rereference(node, path, seq)

    def _rereference(self, node: Node, path: list[Node], seq: list[int]) -> None:
        """Nodes on ``path`` (root to ``node``) that read their tokens from ``seq`` read them from
        a sequence ending below ``node`` instead. NOTE: one left reading ``seq`` is still right (the
        list lives on while read); the tokens are the same from any sequence."""
        leaf, distance = node, 0
        while leaf.children:
            leaf = next(iter(leaf.children.values()))
            distance += leaf.length
        for ref_seq_id, end in leaf.endpoints.items():
            ref = self.seqs[ref_seq_id]
            if ref is seq:
                continue
            ref_idx = end - distance
            for n in reversed(path):
                ref_idx -= n.length
                if n.ref is seq:
                    n.ref, n.ref_idx = ref, ref_idx
            return

    def match(self, context: list[int], start: int) -> tuple[Node | None, int]:
        """The node where ``context[start:]`` ends, and how many of its tokens it reaches (None: no match)."""
        node, idx = self.root, 0
        ref, base = None, 0
        for i in range(start, len(context)):
            token = context[i]
            if idx >= node.length:
                node = node.children.get(token)
                if node is None:
                    return None, -1
                ref, base, idx = node.ref, node.ref_idx, 0
            if ref[base + idx] != token:
                return None, -1
            idx += 1
        return node, idx

    def speculate(self, context: list[int], max_spec_tokens: int, max_tokens_by_match: list[int],
                  min_token_prob: float, seq_id: int | None = None, num_tail: int = 0) -> tuple[list[int], float]:
        """The best draft for ``context`` (its last tokens, at most max_depth), and its score.
        ``max_tokens_by_match[m]``: the most tokens a match of m tokens may draft. ``num_tail``:
        the context's last tokens that are sequence ``seq_id``'s last, whose suffixes' nodes are
        its active nodes (no walk from the root for those)."""
        best, best_score = [], 0.0
        num = len(context)
        active = self.active[seq_id] if num_tail else None
        for match_len in range(1, num):  # NOTE: as Arctic, never the whole context
            max_tokens = min(max_spec_tokens, max_tokens_by_match[match_len], self.max_depth - match_len)
            if max_tokens < best_score:
                continue  # NOTE: each token's probability is <= 1; a longer match may still do better
            if match_len <= num_tail:
                node = active[-match_len]
                idx = node.length
            else:
                node, idx = self.match(context, num - match_len)
                if node is None:
                    break  # a longer suffix is not in the tree either
            draft, score = speculate_path(node, idx, max_tokens, min_token_prob)
            if score >= best_score:
                best, best_score = draft, score
        return best, best_score


def speculate_path(node: Node, idx: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """Follow the first child from ``idx`` tokens into ``node``: the tokens and the sum of their
    probabilities (float32), at most ``max_tokens``, while the probability is >= min_token_prob."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while prob >= min_token_prob:
        room = max_tokens - len(draft)
        if room <= 0:
            break
        if idx < node.length:  # the node's tokens, all at the same probability
            take = min(room, node.length - idx)
            base = node.ref_idx + idx
            draft += node.ref[base : base + take]
            idx += take
            if prob == 1.0:
                score += take  # NOTE: exact: below 1 once, prob never comes back, so score is a whole number
            else:
                for _ in range(take):
                    score = f32(score + prob)
            continue
        child = node.head_child
        if child is None:
            break
        prob = f32(prob * f32(child.count / node.count))
        node, idx = child, 0
    return draft, score
