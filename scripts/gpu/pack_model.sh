#!/usr/bin/env bash
# Here (the CPU machine): pack the default model's q4 copy (the variant the app offers,
# about 119 MB) for the lent GPU machine, which has no network and takes at most 64 MiB a
# run (docs/GPU.md, "The real model on the device"). The weights are split in two parts,
# .gpu_model/a and .gpu_model/b, each carried by its own run and kept by stash_model.sh.
# Usage: bash scripts/gpu/pack_model.sh   (converts the model first if it is not cached yet)
set -e
cd "$(dirname "$0")/../.."
source scripts/env.sh
SRC=$(.venv/bin/python - <<'PY'
from engine.models.default_model import converted_folder, locate_default_gguf
from engine.models.gguf_cache import ensure_converted
print(ensure_converted(locate_default_gguf(), converted_folder(True), True))
PY
)
rm -rf .gpu_model && mkdir -p .gpu_model/a .gpu_model/b
split -n 2 -d "$SRC/model.safetensors" .gpu_model/part_
mv .gpu_model/part_00 .gpu_model/a/ && mv .gpu_model/part_01 .gpu_model/b/
(cd "$SRC" && sha256sum model.safetensors) > .gpu_model/b/model.sha256
for f in "$SRC"/*; do
  [ "$(basename "$f")" = model.safetensors ] || cp "$f" .gpu_model/b/
done
du -sh .gpu_model/a .gpu_model/b
