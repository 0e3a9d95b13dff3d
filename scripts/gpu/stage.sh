#!/usr/bin/env bash
# Here: copy what a GPU run needs from this worktree into the lead's checkout's git-ignored
# .gpu/ (the device tool sends that checkout, not this worktree).
set -e
SRC=$(cd "$(dirname "$0")/../.." && pwd)
DST=/work/main/.gpu
rm -rf "$DST" && mkdir -p "$DST"
tar -C "$SRC" --exclude='__pycache__' --exclude='.kernel_build' -cf - \
  engine shaders tests bench scripts pyproject.toml | tar -C "$DST" -xf -
du -sh "$DST"
