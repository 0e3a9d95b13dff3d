"""The KV pool: one K and one V array per layer, allocated once, written in place.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (head_dim contiguous),
so block ``b`` names the same slot range in every layer. MLX scatters in place only while the
pool array is the sole reference to its buffer, so each layer's array is held here and
nowhere else, and rebound after every write; otherwise each step would silently copy the
whole pool.

The arrays hold one block more than ``num_blocks``: the last, ``SCRATCH_BLOCK``, is never
handed out by the allocator. A step whose shapes are padded to a bucket
(engine/runner/step_batch.py) writes its padding rows' K/V there, so a padding row never
touches a block any sequence holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

#: The scratch block padding rows write to: the pool arrays' last block, one past the
#: allocator's ``num_blocks`` (MLX indexes from the end with a negative index, on every
#: backend). Never read by a real row: no block table names it.
SCRATCH_BLOCK = -1


@dataclass(frozen=True)
class KVShape:
    """What one token's K/V looks like in one layer, and how many layers there are."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size


class KVPool:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        dims = (num_blocks + 1, block_size, shape.num_kv_heads, shape.head_dim)  # + scratch
        self.keys = [mx.zeros(dims, dtype=shape.dtype) for _ in range(shape.num_layers)]
        self.values = [mx.zeros(dims, dtype=shape.dtype) for _ in range(shape.num_layers)]
        mx.eval(self.keys, self.values)

    @property
    def bytes_per_block(self) -> int:
        return self.shape.bytes_per_token() * self.block_size

    @property
    def nbytes(self) -> int:
        """The bytes of the blocks sequences can hold (the scratch block not counted)."""
        return self.bytes_per_block * self.num_blocks

    def write(
        self, layer: int, blocks: mx.array, offsets: mx.array, keys: mx.array, values: mx.array
    ) -> None:
        """Scatter ``keys``/``values`` ([T, kv_heads, head_dim]) into slots (blocks[i],
        offsets[i]) of ``layer``, in place."""
        # Item assignment rebinds the held array to the scatter's result (no second name).
        self.keys[layer][blocks, offsets] = keys.astype(self.shape.dtype)
        self.values[layer][blocks, offsets] = values.astype(self.shape.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src = mx.array([s for s, _ in pairs], dtype=mx.int32)
        dst = mx.array([d for _, d in pairs], dtype=mx.int32)
        # Read the sources first: a scatter whose source still references the pool's buffer
        # could not run in place.
        k_rows = [k[src] for k in self.keys]
        v_rows = [v[src] for v in self.values]
        mx.eval(k_rows, v_rows)
        for layer in range(self.shape.num_layers):
            self.keys[layer][dst] = k_rows[layer]
            self.values[layer][dst] = v_rows[layer]
        del k_rows, v_rows
        mx.eval(self.keys, self.values)
