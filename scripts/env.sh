# Sourced by run.sh: environment for running PagedChat from source.
# On Linux, MLX's CPU wheel bundles a slow reference BLAS; preloading Debian's OpenBLAS
# (the openmp variant: the pthread one aborts at exit, docs/FACTS.md) makes matmuls ~30x faster.
if [ "$(uname -s)" = "Linux" ] && [ -z "${LD_PRELOAD:-}" ]; then
    for lib in /usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0 \
               /usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0; do
        if [ -f "$lib" ]; then export LD_PRELOAD="$lib"; break; fi
    done
fi
