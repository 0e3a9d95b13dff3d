"""A step's layout: which batch row holds which token, where its K/V goes, what it attends to.

A step's work (decode tokens of many sequences plus prefill chunks) is flattened into one
batch of shape ``[T, 1]``, each token its own row (engine/runner/model_adapter.py runs the
model over it): the one-token decodes first, sorted by context length, then padding rows,
then the prompt chunks.

**Stable shapes** (``BUCKET_SHAPES``): the decode rows are padded to ``bucket(n)`` rows, the
block tables to ``bucket(width)`` columns and the LM head's rows to ``bucket(rows)``, so a
steady decode repeats the same shapes from step to step and MLX's CUDA backend reuses its
graphs (it keys them by topology) and the kernels reuse their plans, instead of paying
graph instantiation again whenever the batch or the longest table (every ``block_size``
tokens) changed. A padding row is inert: it feeds token 0 at position 0, writes its K/V to
the pool's scratch block (``kv_pool.SCRATCH_BLOCK``, which no table names), attends to one
slot, and its output is dropped.

**Decode groups**: the kernels read each row's own blocks, whatever the table's width; the
reference path gathers a table's full width for every row of it, so one short chat beside a
long one would pay for the long one's context. The decode rows, sorted by length, are cut
into ``DecodeGroup`` runs of rows whose tables have about the same width, and the reference
path attends group by group (``decode_groups``), each over its own width.

**Drafts as decode rows** (``drafts_as_decodes``, where the decode attention is a kernel): a
work that verifies drafts (its last token and k drafts, engine/sched/speculation.py) is laid
out as k + 1 decode rows of its sequence, the j-th attending to the sequence's first
``start + 1 + j`` tokens through the same block table (every row's K/V is written before the
layer attends, so a draft row sees the drafts before it). The step then keeps one batched
decode launch and a bucketed row count, instead of one prefill call per drafting sequence
whose length (1 to 9 tokens) and table give every drafting step shapes of its own: on a GPU
that is a new graph and new plans nearly every drafting step. The reference path keeps the
chunk layout: it would gather the sequence's blocks once per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.kv.pool import SCRATCH_BLOCK
from engine.sched.work import SequenceWork

#: Pad the step's shapes to buckets (see the module docstring). Off only to compare
#: against the exact shapes (tests).
BUCKET_SHAPES = True
#: What one more attention call costs on the reference path, in row-blocks of gathered K/V
#: (one row over one block): a narrower run of rows is split off only when the row-blocks it
#: saves outweigh it. Measured by bench/decode_groups_cost.py on the CPU with the default
#: model: 80 us per call + 8.5 us per row-block, a call worth 9 row-blocks.
GROUP_CALL_BLOCKS = 8


def bucket(n: int) -> int:
    """``n`` rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, ... (the powers of
    two and 1.5 times them): at most 1.5x the work, and about two buckets per doubling, so
    a batch or a table growing to ``n`` passes through O(log n) shapes."""
    if n <= 2:
        return n
    up = 1 << (n - 1).bit_length()
    return up * 3 // 4 if n <= up * 3 // 4 else up


def blas_rows(n: int) -> int:
    """A step's row count (the model's matmuls' M) as the CPU backend runs it fastest.

    OpenBLAS (the CPU backend's BLAS on Linux, app/core/openblas.py) computes rows in tiles
    of 16: on CI's 2 cores one layer's projections of the default model cost 3.0 ms for 16
    rows, 4.6 for 32, 6.0 for 48, 7.6 for 64, while 12 rows cost 5.0, 20-24 rows 4.9, 36-40
    rows 6.3-6.4 and 52 rows 7.8: rows past a whole tile cost about 0.4 ms each for the first
    three, then more than the rest of the tile (``bench/cpu_matmul_rows.py``; the LM head
    alike). So ``n`` is rounded up to a multiple of 16 unless it is at most 4 rows or 1-3
    rows past a tile; past 128 rows (prompt chunks) no rounding measured cheaper. A decode
    step of eight chats with one sequence verifying a draft fed 10 rows and took 1.3x the
    eight rows' step."""
    past = n % 16
    if n <= 4 or n > 128 or past == 0 or (n > 16 and past <= 3):
        return n
    return n + 16 - past


def bucket_below(n: int) -> int:
    """The largest of 1, 2, 3, 4, 6, 8, 12, 16, ... not above ``n`` (a token budget rounded
    down to a shape :func:`bucket` keeps: engine/sched/prefill_budget.py)."""
    if n <= 2:
        return max(n, 0)
    down = 1 << (n.bit_length() - 1)
    return down * 3 // 2 if n >= down * 3 // 2 else down


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows ``[start, stop)`` whose tables need only their first ``width`` columns."""

    start: int
    stop: int
    width: int


@dataclass(frozen=True)
class PrefillChunk:
    row_start: int
    length: int
    block_table: mx.array  # int32 [nb]: the sequence's blocks, padded to a bucket with 0s
    context_len: int
    #: The same table as [1, nb] and the context length as int32 [1], built once per step
    #: for the kernel instead of once per layer.
    block_tables: mx.array | None = None
    context_lens: mx.array | None = None


@dataclass(frozen=True)
class StepBatch:
    """Per-step metadata, built once and shared by every layer."""

    tokens: mx.array  # [T, 1]
    positions: mx.array  # [T]
    write_blocks: mx.array  # [T]
    write_offsets: mx.array  # [T]
    num_decode: int  # rows [0, num_decode) are one-token decodes (padding rows included)
    decode_tables: mx.array | None  # [num_decode, max_blocks]
    decode_lens: mx.array | None  # [num_decode]
    prefills: tuple[PrefillChunk, ...]
    #: Rows that reach the LM head, in layout order (None: none): the rows whose logits are
    #: returned, then repeats of the last of them up to a bucket (dropped after the head).
    logit_rows: mx.array | None
    logit_owners: tuple[int, ...]  # index into the work list for each returned logit row
    work_rows: tuple[int, ...] = ()  # the first row of each work, in work order
    padding: int = 0  # padding rows, after the real decode rows
    #: The decode rows cut by table width, for the reference path (covers every decode row).
    decode_groups: tuple[DecodeGroup, ...] = ()

    @property
    def longest_prefill(self) -> int:
        """The most query tokens of one prefill chunk in the step (0: none)."""
        return max((c.length for c in self.prefills), default=0)

    @property
    def num_logits(self) -> int:
        """Rows of logits ``PagedModel.forward`` returns (one per ``logit_owners``)."""
        return len(self.logit_owners)


def build_step_batch(work: Sequence[SequenceWork], bucketed: bool | None = None,
                     drafts_as_decodes: bool = False,
                     row_fit: Callable[[int], int] | None = None) -> StepBatch:
    """Lay out a step: one-token works first (shortest context first, one batched decode
    attention on the kernels, one per ``DecodeGroup`` on the reference path), padding rows up
    to a bucket, then chunks. ``bucketed`` (default ``BUCKET_SHAPES``) pads the shapes;
    ``drafts_as_decodes`` lays a work that verifies drafts out as decode rows (see the module
    docstring), else as a chunk. ``row_fit`` (the CPU: :func:`blas_rows`; unused when
    unbucketed) pads a step that has decode rows, and the LM head's rows, further, to the
    row counts its matmuls run fastest at: more padding rows after the decodes."""
    padded = BUCKET_SHAPES if bucketed is None else bucketed
    fit = bucket if padded else _exact
    if not padded:
        row_fit = None

    def one_query_per_row(w: SequenceWork) -> bool:
        return len(w.tokens) == 1 or (drafts_as_decodes and bool(w.drafts))

    decodes = sorted((i for i, w in enumerate(work) if one_query_per_row(w)),
                     key=lambda i: len(work[i].blocks))
    chunks = [i for i, w in enumerate(work) if not one_query_per_row(w)]
    tokens: list[int] = []
    positions: list[int] = []
    blocks: list[int] = []
    offsets: list[int] = []
    prefills: list[PrefillChunk] = []
    logit_rows: list[int] = []
    logit_owners: list[int] = []
    work_rows = [0] * len(work)

    def place(i: int) -> int:
        w = work[i]
        if len(w.slots) != len(w.tokens):
            raise ValueError("every fed token needs a slot")
        row = work_rows[i] = len(tokens)
        tokens.extend(w.tokens)
        positions.extend(range(w.start, w.start + len(w.tokens)))
        for b, o in w.slots:
            blocks.append(b)
            offsets.append(o)
        for j in range(len(w.tokens) - w.num_logits, len(w.tokens)):  # drafts: every row
            logit_rows.append(row + j)
            logit_owners.append(i)
        return row

    for i in decodes:
        place(i)
    decode_rows = len(tokens)
    padding = fit(decode_rows) - decode_rows
    if row_fit is not None and decodes:
        rows = decode_rows + padding + sum(len(work[i].tokens) for i in chunks)
        padding += row_fit(rows) - rows
    tokens.extend([0] * padding)  # token 0 at position 0, its K/V to the scratch block
    positions.extend([0] * padding)
    blocks.extend([SCRATCH_BLOCK] * padding)
    offsets.extend([0] * padding)
    for i in chunks:
        w = work[i]
        row = place(i)
        width = fit(len(w.blocks))
        table = mx.array(list(w.blocks) + [0] * (width - len(w.blocks)), dtype=mx.int32)
        context_len = w.start + len(w.tokens)
        prefills.append(PrefillChunk(
            row_start=row, length=len(w.tokens), block_table=table, context_len=context_len,
            block_tables=table.reshape(1, width),
            context_lens=mx.array([context_len], dtype=mx.int32),
        ))
    decode_tables = decode_lens = None
    groups: tuple[DecodeGroup, ...] = ()
    if decodes:
        # One table row and one length per decode row: a verify work's j-th row attends to
        # its sequence's first start + 1 + j tokens (its own draft's K/V written this step).
        rows_of = [(i, j) for i in decodes for j in range(len(work[i].tokens))]
        widths = [len(work[i].blocks) for i, _ in rows_of]
        width = fit(widths[-1])
        table = [list(work[i].blocks) + [0] * (width - len(work[i].blocks)) for i, _ in rows_of]
        lens = [work[i].start + 1 + j for i, j in rows_of]
        # Padding rows read one slot of block 0 (their output is dropped): in bounds for
        # every kernel, which the scratch block's negative id would not be.
        table.extend([[0] * width] * padding)
        lens.extend([1] * padding)
        decode_tables = mx.array(table, dtype=mx.int32)
        decode_lens = mx.array(lens, dtype=mx.int32)
        groups = decode_groups(widths, padding, fit)
    if logit_rows:  # the LM head on a bucket of rows; the repeats are dropped after it
        head_rows = fit(len(logit_rows))
        if row_fit is not None:
            head_rows = row_fit(head_rows)
        logit_rows.extend([logit_rows[-1]] * (head_rows - len(logit_rows)))
    return StepBatch(
        tokens=mx.array(tokens, dtype=mx.int32)[:, None],
        positions=mx.array(positions, dtype=mx.int32),
        write_blocks=mx.array(blocks, dtype=mx.int32),
        write_offsets=mx.array(offsets, dtype=mx.int32),
        num_decode=decode_rows + padding,
        decode_tables=decode_tables,
        decode_lens=decode_lens,
        prefills=tuple(prefills),
        # No empty arrays: MLX's CUDA graphs fail on a zero-sized launch (docs/GPU.md).
        logit_rows=mx.array(logit_rows, dtype=mx.int32) if logit_rows else None,
        logit_owners=tuple(logit_owners),
        work_rows=tuple(work_rows),
        padding=padding,
        decode_groups=groups,
    )


def decode_groups(widths: list[int], padding: int, fit=bucket) -> tuple[DecodeGroup, ...]:
    """Cut decode rows (``widths``: each row's table width in blocks, ascending; then
    ``padding`` rows that read one slot) into runs that share a bucketed width.

    From the widest run down, a narrower run joins the one above it unless the columns it
    would gather for nothing (rows x extra width) cost more than one more attention call
    (``GROUP_CALL_BLOCKS``). The padding rows, after every real row, join a lone run or
    make a run of width 1 (they attend to one slot).
    """
    runs: list[list[int]] = []  # [start, stop, width], ascending width
    for row, w in enumerate(widths):
        width = fit(w)
        if runs and runs[-1][2] == width:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1, width])
    merged: list[list[int]] = [runs[-1]]
    for start, stop, width in reversed(runs[:-1]):
        above = merged[-1]
        if (stop - start) * (above[2] - width) <= GROUP_CALL_BLOCKS:
            above[0] = start  # join the wider run: cheaper than a call of its own
        else:
            merged.append([start, stop, width])
    merged.reverse()
    if padding:
        if len(merged) == 1:
            merged[0][1] += padding
        else:
            merged.append([len(widths), len(widths) + padding, 1])
    return tuple(DecodeGroup(start, stop, width) for start, stop, width in merged)


def _exact(n: int) -> int:
    return n
