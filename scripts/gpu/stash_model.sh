#!/usr/bin/env bash
# On the lent GPU machine: keep the carried half of the default model's q4 copy
# (.gpu_model/a or .gpu_model/b, packed by pack_model.sh) under /root/stash/model; once both
# halves are there, join them into /root/model-q4 and check the sha256 (docs/GPU.md).
# Usage: bash scripts/gpu/stash_model.sh .gpu_model/a   (then, in the next run, .../b)
set -e
mkdir -p /root/stash/model
cp "$1"/* /root/stash/model/
cd /root/stash/model
if [ -f part_00 ] && [ -f part_01 ]; then
  mkdir -p /root/model-q4
  cat part_00 part_01 > /root/model-q4/model.safetensors
  for f in *; do
    case "$f" in part_*|model.sha256) ;; *) cp "$f" /root/model-q4/ ;; esac
  done
  (cd /root/model-q4 && sha256sum -c /root/stash/model/model.sha256)
  ls -la /root/model-q4
fi
