"""A few decode-attention launches for Nsight Compute (scripts/gpu/verify.sh runs it under ncu):
1B and 8B shapes, 64 sequences, context 2048, bf16."""

import mlx.core as mx

from bench.gpu_bench import SHAPES, attention_case

for name in ("1B", "8B"):
    row = attention_case(SHAPES[name], 64, 2048, mx.bfloat16, repeats=1, layers=2)
    print(name, row)
