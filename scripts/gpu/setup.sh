#!/usr/bin/env bash
# On the lent GPU machine: install MLX's CUDA backend from the wheels carried in .whl/ (the
# mlx-cuda-13 wheel split over two runs, docs/GPU.md) into /root/site, once per lease.
# Usage (from the carried tree's root): source scripts/gpu/setup.sh WHEELS_DIR
set -e
WHL=${1:-.whl/b}
NV=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])")
if [ ! -f /root/site/.installed ]; then
  cat /root/stash/part_00 "$WHL/part_01" > /root/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  (cd /root && sha256sum -c "$OLDPWD/$WHL/cuda.sha256")
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site \
    "$WHL"/mlx-*.whl "$WHL"/mlx_lm-*.whl "$WHL"/llguidance-*.whl /root/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  touch /root/site/.installed
fi
[ -e /root/site/nvidia ] || ln -s "$NV" /root/site/nvidia
export PYTHONPATH=/root/site
export LD_LIBRARY_PATH=$(ls -d "$NV"/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
set +e
