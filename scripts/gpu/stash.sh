#!/usr/bin/env bash
# On the lent GPU machine, the first run of a lease: keep the first half of the mlx-cuda-13
# wheel (carried as .whl/a, docs/GPU.md) for scripts/gpu/setup.sh, which the next run, made
# within the machine's 30 s warm period, completes with .whl/b.
set -e
mkdir -p /root/stash
cp .whl/a/part_00 /root/stash/part_00
ls -la /root/stash
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
