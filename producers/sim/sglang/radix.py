"""SGLang's radix cache: the prefix tree over token ids whose nodes own KV pages.

Follows SGLang 0.5.23 ``srt/mem_cache/radix_cache.py`` (``RadixCache``, the tree a plain
full-attention model's prefix cache is made of; the scheduler wraps it as ``UnifiedRadixCache``
with a Rust tree core, which behaves the same on these paths, see ``conformance``):

- keys are token ids cut to whole pages (``RadixKey.page_aligned``); a child is found by the tokens
  of its first page (``child_key``); a match that ends inside a node splits it there
  (``_split_node``), so every node holds whole pages;
- a node's ``lock_ref`` counts the requests whose prefix runs through it; ``evictable_size`` is the
  tokens of unlocked nodes, ``protected_size`` of locked ones (``inc_lock_ref``/``dec_lock_ref``
  walk to the root, the root is locked once for ever);
- ``insert`` walks the matching path and hangs the unmatched rest on it as one new leaf; it returns
  how many tokens were already in the tree, whose pages the caller then frees as duplicates;
- ``evict`` pops unlocked leaves least recently used first (``LRUStrategy``: ``last_access_time``),
  frees their pages and deletes them; a parent left childless and unlocked joins the heap.

Recency is a logical clock (``tick``) instead of ``time.monotonic()``: one tick when a match or an
insert starts (every node on its path gets it) and one per node created, which is the order SGLang's
timestamps have (a node created during a call is younger than the call's access time).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class Node:
    __slots__ = ("children", "id", "key", "last_access", "lock_ref", "pages", "parent")

    def __init__(self, node_id: int, last_access: int):
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent: Node | None = None
        self.key: tuple[int, ...] = ()
        self.pages: list[int] = []
        self.lock_ref = 0
        self.last_access = last_access
        self.id = node_id


class RadixTree:
    """The prefix tree; pages it evicts go to ``free_pages`` (the token pool's free)."""

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None]):
        self.page_size = page_size
        self._free_pages = free_pages
        self.tick = 0
        self._next_id = 0
        self.root = self._node()
        self.root.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.evictable_leaves: set[Node] = set()
        self.evicted_pages: list[int] = []  # every page evicted since the engine last took them

    def _node(self) -> Node:
        self.tick += 1
        node = Node(self._next_id, self.tick)
        self._next_id += 1
        return node

    def _child_key(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[:self.page_size]

    def _aligned(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[:len(key) // self.page_size * self.page_size]

    def _match_len(self, a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        limit = min(len(a), len(b))
        while n < limit and a[n] == b[n]:
            n += 1
        return n // self.page_size * self.page_size

    # ------------------------------------------------------------------ queries
    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def match_prefix(self, tokens: tuple[int, ...]) -> tuple[int, Node]:
        """Tokens of the longest cached page-aligned prefix of ``tokens`` and its last node."""
        key = self._aligned(tokens)
        if not key:
            return 0, self.root
        self.tick += 1
        now = self.tick
        node = self.root
        node.last_access = now
        matched = 0
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            child.last_access = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                matched += n
                break
            matched += n
            node = child
            key = key[n:]
        return matched, node

    def path_pages(self, node: Node) -> list[int]:
        parts = []
        while node is not self.root:
            parts.append(node.pages)
            node = node.parent
        return [p for part in reversed(parts) for p in part]

    # ------------------------------------------------------------------ structure
    def _split(self, child: Node, split_len: int) -> Node:
        ps = self.page_size
        new = self._node()
        new.parent = child.parent
        new.lock_ref = child.lock_ref
        new.key = child.key[:split_len]
        new.pages = child.pages[:split_len // ps]
        child.key = child.key[split_len:]
        child.pages = child.pages[split_len // ps:]
        new.children = {self._child_key(child.key): child}
        child.parent = new
        new.parent.children[self._child_key(new.key)] = new
        return new

    def insert(self, tokens: tuple[int, ...], pages: list[int]) -> tuple[int, Node]:
        """Insert ``tokens`` (cut to whole pages) owning ``pages``; (tokens already present, last node)."""
        key = self._aligned(tokens)
        pages = pages[:len(key) // self.page_size]
        self.tick += 1
        now = self.tick
        node = self.root
        node.last_access = now
        if not key:
            return 0, node
        ps = self.page_size
        total = 0
        while key and self._child_key(key) in node.children:
            node = node.children[self._child_key(key)]
            node.last_access = now
            n = self._match_len(node.key, key)
            total += n
            key, pages = key[n:], pages[n // ps:]
            if n < len(node.key):
                node = self._split(node, n)
        if key:
            leaf = self._node()
            leaf.parent = node
            leaf.key = key
            leaf.pages = list(pages)
            node.children[self._child_key(key)] = leaf
            self.evictable_size_ += len(key)
            self._update_leaf(node)
            self._update_leaf(leaf)
            node = leaf
        return total, node

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
            node.lock_ref += 1
            self._update_leaf(node)
            node = node.parent

    def dec_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
            node.lock_ref -= 1
            self._update_leaf(node)
            node = node.parent

    def _update_leaf(self, node: Node) -> None:
        if node.lock_ref > 0 or any(True for _ in node.children):
            self.evictable_leaves.discard(node)
        else:
            self.evictable_leaves.add(node)

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` are freed or none is
        left; the tokens freed."""
        heap = [(leaf.last_access, leaf.id, leaf) for leaf in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self._free_pages(leaf.pages)
            self.evicted_pages.extend(leaf.pages)
            evicted += len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            self.evictable_size_ -= len(leaf.key)
            self.evictable_leaves.discard(leaf)
            leaf.pages = []
            self._update_leaf(parent)
            if not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return evicted
