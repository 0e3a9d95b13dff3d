#!/usr/bin/env bash
# ./run.sh        set everything up, then launch PagedChat
# ./run.sh test   set everything up, then run the whole test suite (what CI runs)
# ./run.sh bench  set everything up, then run the engine benchmarks
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
source scripts/env.sh
case "${1:-run}" in
    test)
        shift
        .venv/bin/ruff check .
        .venv/bin/lint-imports --no-logo  # the layer contracts in pyproject.toml
        # Two worker processes, one test file each at a time (docs/CONTRIBUTING.md says why);
        # PAGEDCHAT_TEST_WORKERS=0 (or -n 0 among the arguments) runs it in one process.
        exec .venv/bin/python -m pytest -n "${PAGEDCHAT_TEST_WORKERS:-2}" --dist loadfile "$@"
        ;;
    bench)
        shift
        exec .venv/bin/python -m bench.engine_bench "$@"
        ;;
    run)
        shift || true
        exec .venv/bin/pagedchat "$@"
        ;;
    *)
        exec .venv/bin/pagedchat "$@"
        ;;
esac
