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

An **8-bit pool** (``KVShape.quantized``, issue #26) stores K and V as int8 with one fp16
scale per (slot, KV head) in ``k_scales`` / ``v_scales`` ([num_blocks + 1, block_size,
num_kv_heads] per layer), quantized as they are written (engine/kv/int8.py). A block id
names the same slots in the scale arrays as in K and V, so everything that moves block ids
(prefix sharing, copy-on-write, preemption) works on 8-bit blocks unchanged; ``copy_blocks``
copies the scales with the bytes.

On CUDA's kernel path a step writes differently: one kernel launch a layer stores the rows
into these arrays' buffers without MLX knowing (engine/attention/kv_write.py says why and what
keeps it sound), so a step then rebinds nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.kv import int8

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
    dtype: mx.Dtype  # what the model computes K/V in (and what attention reads them as)
    quantized: bool = False  # stored as int8 + one fp16 scale per (token, KV head)

    def bytes_per_token(self) -> int:
        if self.quantized:
            per_head = self.head_dim * int8.INT8.size + int8.SCALE_DTYPE.size
        else:
            per_head = self.head_dim * self.dtype.size
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def storage_dtype(self) -> mx.Dtype:
        """The element type of the pool's K and V arrays."""
        return int8.INT8 if self.quantized else self.dtype


class KVPool:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        dims = (num_blocks + 1, block_size, shape.num_kv_heads, shape.head_dim)  # + scratch
        store = shape.storage_dtype
        self.keys = [mx.zeros(dims, dtype=store) for _ in range(shape.num_layers)]
        self.values = [mx.zeros(dims, dtype=store) for _ in range(shape.num_layers)]
        #: 8-bit pools: per layer, one fp16 scale per (slot, KV head); empty otherwise.
        self.k_scales: list[mx.array] = []
        self.v_scales: list[mx.array] = []
        if shape.quantized:
            sdims = dims[:3]
            self.k_scales = [mx.zeros(sdims, dtype=int8.SCALE_DTYPE)
                             for _ in range(shape.num_layers)]
            self.v_scales = [mx.zeros(sdims, dtype=int8.SCALE_DTYPE)
                             for _ in range(shape.num_layers)]
        mx.eval(self.arrays())

    @property
    def quantized(self) -> bool:
        return self.shape.quantized

    def arrays(self) -> list[mx.array]:
        """Every array of the pool (K, V and, in an 8-bit pool, their scales)."""
        return [*self.keys, *self.values, *self.k_scales, *self.v_scales]

    def scales(self, layer: int) -> tuple[mx.array | None, mx.array | None]:
        """``layer``'s K and V scales, or (None, None) in a pool of the model's own dtype."""
        if not self.shape.quantized:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

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
        if self.shape.quantized:
            self.write_quantized(layer, blocks, offsets, *int8.quantize_kv(keys, values))
            return
        self.keys[layer][blocks, offsets] = keys.astype(self.shape.dtype)
        self.values[layer][blocks, offsets] = values.astype(self.shape.dtype)

    def write_quantized(self, layer: int, blocks: mx.array, offsets: mx.array, k_q: mx.array,
                        k_scales: mx.array, v_q: mx.array, v_scales: mx.array) -> None:
        """An 8-bit pool's write of rows already quantized as engine/kv/int8.py does
        (int8 [T, kv_heads, head_dim] and fp16 scales [T, kv_heads]; on CUDA one kernel
        launch makes them, engine/attention/kv_write.py), in place."""
        if not self.shape.quantized:
            raise ValueError("quantized rows go into an 8-bit pool only")
        self.keys[layer][blocks, offsets] = k_q
        self.values[layer][blocks, offsets] = v_q
        self.k_scales[layer][blocks, offsets] = k_scales
        self.v_scales[layer][blocks, offsets] = v_scales

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of shared blocks)."""
        if not pairs:
            return
        src = mx.array([s for s, _ in pairs], dtype=mx.int32)
        dst = mx.array([d for _, d in pairs], dtype=mx.int32)
        # Read the sources first: a scatter whose source still references the pool's buffer
        # could not run in place.
        held = [self.keys, self.values, self.k_scales, self.v_scales]
        rows = [[a[src] for a in arrays] for arrays in held]
        mx.eval(rows)
        for arrays, copied in zip(held, rows, strict=True):
            for layer, r in enumerate(copied):
                arrays[layer][dst] = r
        del rows
        mx.eval(self.arrays())

    # ---- the disk tier (engine/kv/disk_tier.py): whole blocks to and from host memory -----

    def host_dtype(self, dtype: mx.Dtype) -> np.dtype:
        """The numpy dtype a pool array travels to the host as (bfloat16, which numpy does
        not know, as its bits in uint16)."""
        return np.dtype(np.uint16) if dtype == mx.bfloat16 else np.dtype(_NUMPY[dtype])

    def _held(self) -> list[list[mx.array]]:
        return [self.keys, self.values, *([self.k_scales, self.v_scales]
                                           if self.shape.quantized else [])]

    def read_blocks(self, blocks: list[int]) -> list[np.ndarray]:
        """Copies of ``blocks`` in every layer, on the host: K, V (and an 8-bit pool's K and
        V scales), each ``[layers, len(blocks), ...]`` in the pool's own format. Evaluated
        before returning, so no lazy read holds a reference to the pool's buffers (the next
        write would copy the whole pool)."""
        idx = mx.array(blocks, dtype=mx.int32)
        stacked = [mx.stack([a[idx] for a in arrays]) for arrays in self._held()]
        mx.eval(stacked)
        out = []
        for a in stacked:
            bits = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            out.append(np.array(bits, copy=True))
        return out

    def write_blocks(self, blocks: list[int], parts: list[np.ndarray]) -> None:
        """Write whole blocks back (``parts`` as ``read_blocks`` returns them), in place."""
        idx = mx.array(blocks, dtype=mx.int32)
        for arrays, part in zip(self._held(), parts, strict=True):
            for layer, a in enumerate(arrays):
                # contiguous first: MLX converts a strided numpy array element by element
                # (measured: 48 ms against 1.5 ms a layer of 48 blocks)
                value = mx.array(np.ascontiguousarray(part[layer]))
                if a.dtype == mx.bfloat16:
                    value = value.view(mx.bfloat16)
                arrays[layer][idx] = value
        mx.eval(self.arrays())

    def zero_blocks(self, blocks: list[int]) -> None:
        """Overwrite ``blocks`` with zeros in every layer (an incognito chat's, released)."""
        if not blocks:
            return
        idx = mx.array(blocks, dtype=mx.int32)
        for arrays in self._held():
            for layer, a in enumerate(arrays):
                arrays[layer][idx] = mx.zeros((len(blocks), *a.shape[1:]), dtype=a.dtype)
        mx.eval(self.arrays())


_NUMPY = {mx.float32: np.float32, mx.float16: np.float16, mx.int8: np.int8}
