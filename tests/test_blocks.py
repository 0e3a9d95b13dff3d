"""Property tests of the block allocator: random allocate / append / fork / free / evict
sequences, with every invariant of docs/ARCHITECTURE.md §3.2 checked after each operation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.block_table import PENDING, BlockTable, NoFreeBlocksError
from engine.kv.blocks import BlockAllocator
from engine.kv.invariants import check_invariants

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=40)


class AllocatorMachine(RuleBasedStateMachine):
    """The tables model what the scheduler does: prompts that reuse the cache, decode appends,
    forks (parallel samples), frees (finish, cancel, preempt)."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(num_blocks=12, block_size=4)
        self.tables: list[BlockTable] = []
        self.counter = 0

    def _owner(self) -> str:
        self.counter += 1
        return f"s{self.counter % 3}"

    @rule(prompt=TOKENS)
    def admit(self, prompt: list[int]) -> None:
        table = BlockTable(owner=self._owner())
        cached = self.alloc.reuse_prefix(table, prompt)
        assert cached % self.alloc.block_size == 0 and cached < len(prompt)
        assert table.tokens == prompt[:cached]
        try:
            self.alloc.append(table, prompt[cached:])
        except NoFreeBlocksError:
            self.alloc.free(table)  # the scheduler would leave it waiting
            return
        self.alloc.mark_computed(table)
        self.tables.append(table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), tokens=TOKENS)
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        table = data.draw(st.sampled_from(self.tables))
        self._settle(table, 1)
        before = (list(table.blocks), list(table.tokens))
        available = self.alloc.num_available
        needed = self.alloc.blocks_needed(table, len(tokens))
        try:
            result = self.alloc.append(table, tokens)
        except NoFreeBlocksError:
            assert needed > available
            assert (table.blocks, table.tokens) == before, "a failed append changed the table"
            return
        assert needed <= available
        assert len(result.slots) == len(tokens)
        assert table.tokens == before[1] + tokens
        for src, dst in result.copies:
            assert src in before[0] and dst not in before[0]
        self.alloc.mark_computed(table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.tables))
        self._settle(parent, 2)
        child = self.alloc.fork(parent, owner=self._owner())
        assert child.blocks == parent.blocks and child.tokens == parent.tokens
        self.tables.append(child)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables))
        self.tables.remove(table)
        self.alloc.free(table)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def append_in_flight(self, data: st.DataObject) -> None:
        """An overlapped step feeds a token still on the device: a PENDING slot."""
        table = data.draw(st.sampled_from(self.tables))
        self._settle(table, 0)
        try:
            self.alloc.append(table, [PENDING])
        except NoFreeBlocksError:
            return
        self.alloc.mark_computed(table)

    @precondition(lambda self: any(t.tokens and t.tokens[-1] == PENDING for t in self.tables))
    @rule(data=st.data(), token=st.integers(0, 2))
    def resolve(self, data: st.DataObject, token: int) -> None:
        pending = [t for t in self.tables if t.tokens and t.tokens[-1] == PENDING]
        self._settle(data.draw(st.sampled_from(pending)), token)

    def _settle(self, table: BlockTable, token: int) -> None:
        """The step in flight is read before the table grows again (as the engine does)."""
        if table.tokens and table.tokens[-1] == PENDING:
            self.alloc.resolve_pending(table, token)
            self.alloc.mark_computed(table)

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.alloc, self.tables)

    def teardown(self) -> None:
        for table in self.tables:
            self.alloc.free(table)
        check_invariants(self.alloc, [])
        for block in range(self.alloc.num_blocks):
            assert self.alloc.refcount(block) == 0  # every block free or cached


TestAllocatorProperties = AllocatorMachine.TestCase
TestAllocatorProperties.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _admit(alloc: BlockAllocator, prompt: list[int], owner: str = "a") -> BlockTable:
    table = BlockTable(owner=owner)
    cached = alloc.reuse_prefix(table, prompt)
    alloc.append(table, prompt[cached:])
    alloc.mark_computed(table)
    return table


def test_prefix_reuse_counts_hits_and_never_takes_the_last_token() -> None:
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    first = _admit(alloc, list(range(12)))
    second = BlockTable(owner="b")
    assert alloc.reuse_prefix(second, list(range(12))) == 8  # 12th token must be computed
    assert second.blocks == first.blocks[:2]
    assert alloc.prefix_hits == 2
    assert all(alloc.refcount(b) == 2 for b in first.blocks[:2])


def test_freed_cached_blocks_are_reused_until_evicted_by_pressure() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    first = _admit(alloc, list(range(9)))
    cached_blocks = first.blocks[:2]
    alloc.free(first)
    assert all(alloc.is_cached(b) for b in cached_blocks)
    again = BlockTable(owner="b")
    assert alloc.reuse_prefix(again, list(range(9))) == 8
    alloc.free(again)
    # Other content needs every block: the cached ones are evicted and lose their names.
    other = _admit(alloc, [7] * 16)
    assert set(cached_blocks) <= set(other.blocks)
    fresh = BlockTable(owner="c")
    alloc.free(other)
    assert alloc.reuse_prefix(fresh, list(range(9))) == 0


def test_copy_on_write_copies_the_shared_partial_block_only() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    parent = _admit(alloc, [1, 2, 3, 4, 5, 6])
    child = alloc.fork(parent, owner="b")
    result = alloc.append(child, [9])
    assert result.copies == [(parent.blocks[1], child.blocks[1])]
    assert child.blocks[0] == parent.blocks[0]  # the full block stays shared
    assert alloc.block_tokens(parent.blocks[1]) == (5, 6)
    assert alloc.block_tokens(child.blocks[1]) == (5, 6, 9)
    # The parent now owns its partial block alone: no copy on its next write.
    assert alloc.append(parent, [8]).copies == []


def test_failed_append_is_all_or_nothing() -> None:
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    table = _admit(alloc, [1, 2, 3])
    with pytest.raises(NoFreeBlocksError):
        alloc.append(table, list(range(10)))
    assert table.tokens == [1, 2, 3] and len(table.blocks) == 1
    check_invariants(alloc, [table])


def test_identical_prefixes_computed_at_once_keep_one_cached_copy() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = BlockTable(owner="a")
    b = BlockTable(owner="b")
    for t in (a, b):
        alloc.reuse_prefix(t, [1, 2, 3, 4, 5])
        alloc.append(t, [1, 2, 3, 4, 5])
    for t in (a, b):
        alloc.mark_computed(t)
    check_invariants(alloc, [a, b])  # includes: no two cached blocks share a hash
    assert alloc.is_cached(a.blocks[0]) != alloc.is_cached(b.blocks[0])


def test_a_pending_token_is_hashed_and_shown_only_once_resolved() -> None:
    from engine.kv.block_table import PENDING

    alloc = BlockAllocator(8, 4)
    table = BlockTable(owner="s")
    alloc.append(table, [1, 2, 3])
    alloc.mark_computed(table)
    alloc.append(table, [PENDING])  # the block is full, its last token not known yet
    assert table.hashes == []
    assert alloc.block_state()[4][table.blocks[0]] == (1, 2, 3)
    check_invariants(alloc, [table])
    alloc.resolve_pending(table, 4)
    alloc.mark_computed(table)
    assert alloc.block_state()[4][table.blocks[0]] == (1, 2, 3, 4)
    check_invariants(alloc, [table])
    other = BlockTable(owner="t")
    assert alloc.reuse_prefix(other, [1, 2, 3, 4, 5]) == 4  # named in the prefix cache
