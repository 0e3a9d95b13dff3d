"""PyInstaller runtime hook (Linux bundle): restart once with Debian's OpenBLAS preloaded.

Why: MLX's Linux CPU wheel links a slow reference BLAS; preloading the openmp variant of
OpenBLAS makes its matmuls ~30x faster (docs/FACTS.md; from source, scripts/env.sh does it). A
preload must be in place before the process starts, so the frozen app re-executes itself
once with LD_PRELOAD set, when the library is installed (``apt-get install
libopenblas0-openmp``) and nothing is preloaded yet. Measured here with the frozen
``--self-test`` on an idle 2-core machine: prompt + 8 tokens in 1.1-1.2 s with it against
8.0-8.5 s without (whole self-test 5 s against 12 s). Only the openmp variant: the pthread
one aborts at exit after MLX ran in a second thread. Its OpenMP threads are told to sleep
between matmuls rather than spin (``OMP_WAIT_POLICY=PASSIVE``, docs/FACTS.md). Set
PAGEDCHAT_NO_OPENBLAS=1 to opt out. Does nothing on macOS (Metal).
"""

import os
import sys

OPENBLAS_OPENMP = (
    "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0",
)


def _preload_openblas() -> None:
    if not sys.platform.startswith("linux") or not getattr(sys, "frozen", False):
        return
    if os.environ.get("LD_PRELOAD") or os.environ.get("PAGEDCHAT_NO_OPENBLAS") == "1":
        return  # already preloaded (this is the restarted process), or opted out
    lib = next((p for p in OPENBLAS_OPENMP if os.path.isfile(p)), None)
    if lib is None:
        return
    env = dict(os.environ, LD_PRELOAD=lib)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # its threads sleep: app/core/openblas.py
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv[1:]], env)
    except OSError:
        pass  # could not restart: run on as is, only slower


_preload_openblas()
