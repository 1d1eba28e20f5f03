"""Paged KV blocks: allocation with reference counts, copy-on-write for forked sequences, and prefix caching.

A sequence owns a list of block ids (its block table); position p lives in block ``table[p // block_size]``.
Blocks are reference counted: forked sequences (n > 1, beam search) and prefix-cache hits share blocks. A shared
block is never written: a sequence about to write into one gets a private copy first (copy-on-write; the runner
copies the block's k/v before the forward).

Prefix caching: a full block is keyed by a chained hash ``hash(parent key, its tokens, its media keys)``, so a key
names the whole prefix up to the block's end. A computed full block is registered under its key; a new sequence
reuses the longest run of registered blocks that starts its prompt. A block whose last reference goes stays
registered but evictable; allocation takes never-used blocks first, then evicts the least recently freed cached
block (LRU; the tail blocks of a sequence are freed first, so a shared prompt head outlives its tails).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field


def block_keys(tokens: Sequence[int], block_size: int, extra: Sequence[tuple] = (), parent: int | None = None,
               start: int = 0) -> list[int]:
    """Chained keys of the full blocks of ``tokens`` from block ``start`` on (``parent``: the key of block
    start-1). ``extra[i]``: what else block i's content depends on (the hashes of images overlapping it)."""
    keys = []
    for i in range(start, len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size]),
                       extra[i] if i < len(extra) else ()))
        keys.append(parent)
    return keys


@dataclass
class BlockTable:
    """The blocks of one sequence and how many of its tokens have k/v in them."""

    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    """Chained keys of its leading full, computed blocks (registered or not)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.key_of: list[int | None] = [None] * num_blocks  # registered prefix key of a block
        self.block_of: dict[int, int] = {}  # prefix key -> block
        self.clean: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self.cached: OrderedDict[int, None] = OrderedDict()  # free but registered, oldest first (LRU)
        self.num_evictions = 0
        self.hit_tokens = 0
        self.query_tokens = 0

    # ---- accounting ----
    @property
    def num_free(self) -> int:
        return len(self.clean) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ---- prefix cache ----
    def match(self, keys: Sequence[int], limit_tokens: int) -> list[int]:
        """Registered blocks for the leading ``keys`` (at most ``limit_tokens`` tokens' worth); nothing taken yet."""
        if not self.prefix_caching:
            return []
        hit = []
        for key in keys[: limit_tokens // self.block_size]:
            b = self.block_of.get(key)
            if b is None:
                break
            hit.append(b)
        return hit

    def record_query(self, prompt_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def register(self, table: BlockTable, keys: Sequence[int]) -> None:
        """Record the keys of ``table``'s newly computed full blocks (in order, after ``table.keys``); each block is
        registered unless another block already holds its key."""
        for key in keys:
            b = table.blocks[len(table.keys)]
            table.keys.append(key)
            if self.prefix_caching and key not in self.block_of and self.key_of[b] is None:
                self.block_of[key] = b
                self.key_of[b] = key

    # ---- allocation ----
    def _take_free(self) -> int:
        if self.clean:
            b = self.clean.popleft()
        else:
            b, _ = self.cached.popitem(last=False)
            del self.block_of[self.key_of[b]]
            self.key_of[b] = None
            self.num_evictions += 1
        self.ref[b] = 1
        return b

    def cost(self, table: BlockTable, computed: int, n_new: int, hit: Sequence[int] = ()) -> int:
        """Free blocks needed to write ``n_new`` tokens after the ``computed`` ones of ``table`` and the prefix
        ``hit`` blocks it takes first."""
        need = max(0, self.blocks_for(computed + len(hit) * self.block_size + n_new) - len(table.blocks) - len(hit))
        if hit:
            need += sum(1 for b in hit if self.ref[b] == 0)  # an evictable hit leaves the free pool
        return need + self._shared_tail(table, computed, n_new)  # copy-on-write

    def _shared_tail(self, table: BlockTable, computed: int, n_new: int) -> bool:
        """The first new token lands in a block ``table`` shares (a forked sequence's partial block)."""
        first = computed // self.block_size
        return bool(n_new) and first < len(table.blocks) and self.ref[table.blocks[first]] > 1

    def allocate(self, table: BlockTable, computed: int, n_new: int, hit: Sequence[int] = ()) -> list[tuple[int, int]]:
        """Give ``table`` room for ``n_new`` tokens after its ``computed`` ones and the prefix ``hit`` blocks (taken
        first); -> the (src, dst) block copies to make before the forward. The caller checked :meth:`cost`
        against :attr:`num_free`."""
        copies = []
        if self._shared_tail(table, computed, n_new):
            first = computed // self.block_size
            old, new = table.blocks[first], self._take_free()
            self.ref[old] -= 1  # others still hold it (ref was > 1)
            table.blocks[first] = new
            copies.append((old, new))
        for b in hit:
            if self.ref[b] == 0:
                del self.cached[b]
            self.ref[b] += 1
            table.blocks.append(b)
        for _ in range(self.blocks_for(computed + len(hit) * self.block_size + n_new) - len(table.blocks)):
            table.blocks.append(self._take_free())
        return copies

    def fork(self, parent: BlockTable) -> BlockTable:
        """A table sharing every block of ``parent`` (a child sequence; written blocks are copied on write)."""
        for b in parent.blocks:
            self.ref[b] += 1
        return BlockTable(list(parent.blocks), list(parent.keys))

    def free(self, table: BlockTable) -> None:
        """Drop ``table``'s references, tail first (so cached tails are evicted before shared heads)."""
        for b in reversed(table.blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key_of[b] is not None:
                    self.cached[b] = None
                else:
                    self.clean.append(b)
        table.blocks.clear()
        table.keys.clear()


class StateSlots:
    """Slots of the fixed-size per-sequence state of linear-attention layers (titan_mm.nn.kv_cache
    StatePool): a sequence takes one when it is scheduled and gives it back when it finishes, is dropped or is
    preempted; a fork takes its own (the runner copies the parent's state into it). The scheduler's seats
    (max_num_seqs) bound the live sequences, so the pool has one slot per seat."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    def take(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"all {self.num_slots} state slots are taken: more sequences are live than "
                               "serve.max_num_seqs seats")
        return self.free_slots.popleft()

    def free(self, slot: int | None) -> None:
        if slot is not None:
            self.free_slots.append(slot)
