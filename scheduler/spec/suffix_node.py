"""A node of the suffix tree (scheduler/spec/suffix_tree.py) and the order of its children.

Drafting follows a node's first child, its most frequent one. Among children of equal count,
which one is first depends on the order counts changed in, so each node keeps its children as
Arctic Inference's ``SuffixTree`` does: a list in decreasing count, cut in groups of equal
count (each group knows its head, so a move costs O(1)); a new child goes to the back; an
incremented child goes to the front of its new group when it headed its old one, else to the
back of it; a decremented child goes to the front of its new group.
"""

from __future__ import annotations


class Group:
    """Siblings of one count, contiguous in their parent's list; ``head`` is the first."""

    __slots__ = ("head", "prev", "next")

    def __init__(self, head: Node):
        self.head, self.prev, self.next = head, None, None


class Node:
    """A run of tokens on a path from the root, and how many times the path up to it occurs."""

    __slots__ = ("count", "token", "length", "ref", "ref_idx", "parent", "children", "endpoints",
                 "head_child", "tail_child", "prev_sibling", "next_sibling", "group")

    def __init__(self, count: int, token: int, length: int, ref: list[int] | None, ref_idx: int, parent: Node | None):
        self.count, self.token, self.length = count, token, length
        self.ref, self.ref_idx = ref, ref_idx  # the node's tokens: ref[ref_idx : ref_idx + length]
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token -> child
        self.endpoints: dict[int, int] = {}  # seq_id -> end index of its suffixes ending here
        self.head_child = self.tail_child = None  # the children by decreasing count
        self.prev_sibling = self.next_sibling = None
        self.group: Group | None = None


def unlink(node: Node) -> None:
    """Take a child out of its parent's list and of its group."""
    group = node.group
    nxt, prev = node.next_sibling, node.prev_sibling
    if group.head is node:
        if nxt is not None and nxt.count == node.count:
            group.head = nxt
        else:  # alone in its group: the group goes too
            if group.prev is not None:
                group.prev.next = group.next
            if group.next is not None:
                group.next.prev = group.prev
    node.group = None
    parent = node.parent
    if nxt is not None:
        nxt.prev_sibling = prev
    else:
        parent.tail_child = prev
    if prev is not None:
        prev.next_sibling = nxt
    else:
        parent.head_child = nxt
    node.prev_sibling = node.next_sibling = None


def new_group(node: Node) -> Group:
    """A group of ``node`` alone (a node's first child's)."""
    return Group(node)


def _link_group_between(node: Node, before: Group | None, after: Group | None) -> None:
    group = node.group = Group(node)
    group.prev, group.next = before, after
    if before is not None:
        before.next = group
    if after is not None:
        after.prev = group


def insert_before(node: Node, other: Node) -> None:
    """Link ``node`` just before its sibling ``other``."""
    prev = other.prev_sibling
    if prev is not None:
        prev.next_sibling = node
    else:
        node.parent.head_child = node
    node.prev_sibling, node.next_sibling = prev, other
    other.prev_sibling = node
    if prev is not None and prev.count == node.count:
        node.group = prev.group  # the back of the group before
    elif other.count == node.count:
        node.group = other.group
        node.group.head = node
    else:
        _link_group_between(node, None if prev is None else prev.group, other.group)


def insert_after(node: Node, other: Node) -> None:
    """Link ``node`` just after its sibling ``other``."""
    nxt = other.next_sibling
    if nxt is not None:
        nxt.prev_sibling = node
    else:
        node.parent.tail_child = node
    node.prev_sibling, node.next_sibling = other, nxt
    other.next_sibling = node
    if nxt is not None and nxt.count == node.count:
        node.group = nxt.group
        if node.group.head is nxt:
            node.group.head = node
    elif other.count == node.count:
        node.group = other.group
    else:
        _link_group_between(node, other.group, None if nxt is None else nxt.group)


def replace_in_siblings(old: Node, new: Node) -> None:
    """``new`` (of the same count) takes ``old``'s place among its siblings."""
    parent = old.parent
    nxt, prev = old.next_sibling, old.prev_sibling
    if nxt is not None:
        nxt.prev_sibling = new
    else:
        parent.tail_child = new
    if prev is not None:
        prev.next_sibling = new
    else:
        parent.head_child = new
    new.prev_sibling, new.next_sibling = prev, nxt
    old.prev_sibling = old.next_sibling = None
    group = new.group = old.group
    if group.head is old:
        group.head = new
    old.group = None


def increment_count(node: Node) -> None:
    """count + 1, keeping the siblings in order (see the module's docstring)."""
    prev = node.prev_sibling
    if node.parent is None:
        pass
    elif prev is None or prev.count > node.count + 1:  # stays where it is, first of its new count
        nxt = node.next_sibling
        if nxt is not None and nxt.count == node.count:
            old = node.group
            old.head = nxt
            _link_group_between(node, old.prev, old)
    else:
        other = prev.group.head
        unlink(node)
        node.count += 1
        insert_before(node, other)
        return
    node.count += 1


def decrement_count(node: Node) -> None:
    """count - 1, keeping the siblings in order: first among those of its new count."""
    nxt = node.next_sibling
    if node.parent is None:
        pass
    elif nxt is None or nxt.count < node.count - 1:  # stays where it is
        prev = node.prev_sibling
        if prev is not None and prev.count == node.count:
            old = node.group
            _link_group_between(node, old, old.next)
    elif nxt.count == node.count - 1:  # joins the next group, as its head
        group = node.group
        if group.head is node:  # its group goes
            if group.prev is not None:
                group.prev.next = group.next
            group.next.prev = group.prev
        node.group = nxt.group
        node.group.head = node
    else:  # moves past the rest of its group
        after = node.group.next
        unlink(node)
        node.count -= 1
        if after is None:
            insert_after(node, node.parent.tail_child)
        else:
            insert_before(node, after.head)
        return
    node.count -= 1
