# Sourced by run.sh: environment for running PagedChat from source.
# On Linux, MLX's CPU wheel bundles a slow reference BLAS; preloading Debian's OpenBLAS
# (the openmp variant: the pthread one aborts at exit, docs/FACTS.md) makes matmuls ~30x faster.
if [ "$(uname -s)" = "Linux" ] && [ -z "${LD_PRELOAD:-}" ]; then
    for lib in /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0 \
               /usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0; do
        if [ -f "$lib" ]; then export LD_PRELOAD="$lib"; break; fi
    done
fi
# OpenBLAS's OpenMP threads sleep between matmuls instead of spinning on the cores that the
# Python threads and the CPU attention kernel need: mlx-lm's decode takes 0.88x the time,
# and a prompt chunk's attention can use both cores (docs/FACTS.md). libgomp reads it when
# it loads.
if [ "$(uname -s)" = "Linux" ]; then export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"; fi
