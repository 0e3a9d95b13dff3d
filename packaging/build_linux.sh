#!/usr/bin/env bash
# Build the Linux one-folder PagedChat (dist/PagedChat/) from packaging/pagedchat.spec and run
# its --self-test headless: the CI proxy for the macOS .app (same spec, same self-test).
#
#   packaging/build_linux.sh                 set up, build, self-test
#   SKIP_SELF_TEST=1 packaging/build_linux.sh   build only
#   PAGEDCHAT_CACHE_DIR=DIR ...              where the frozen self-test converts the model
#                                            (default build/selftest-cache: kept between
#                                            builds, separate from the user's cache)
#
# Deterministic inputs: pinned versions (pyproject.toml: the project and its `package` extra),
# PYTHONHASHSEED=0 and SOURCE_DATE_EPOCH from the last commit. Fast: PyInstaller's work folder
# (build/pyinstaller) is kept between runs so unchanged binaries are not re-analysed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
DIST=dist
WORK=build/pyinstaller
APP_DIR=$DIST/PagedChat

scripts/setup.sh  # .venv with the project, the embedded model and the system libraries

# The `package` extra (PyInstaller, its hooks, Pillow), installed from pyproject's pins
# without reinstalling the project itself; skipped when pyproject.toml has not changed.
stamp=.venv/.package-stamp
want=$(sha1sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$PY" - <<'EOF' > .venv/package-requirements.txt
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["package"]))
EOF
    "$PY" -m pip install -q -r .venv/package-requirements.txt
    echo "$want" > "$stamp"
fi

export PYTHONHASHSEED=0
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 0)
export SOURCE_DATE_EPOCH
# Never analyse with OpenBLAS preloaded (scripts/env.sh): ldd would then list it and
# PyInstaller would copy the machine's OpenBLAS and libgomp into the bundle.
start=$(date +%s)
rm -rf "$APP_DIR"
env -u LD_PRELOAD "$PY" -m PyInstaller --noconfirm --log-level WARN \
    --workpath "$WORK" --distpath "$DIST" packaging/pagedchat.spec
# Same inputs -> same tree: file times from the commit, not the build (this also keeps the
# bundled GGUF's mtime, part of the model cache's key, stable between rebuilds of a commit).
find "$APP_DIR" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
built=$(date +%s)
echo "build_linux: built $APP_DIR in $((built - start)) s;" \
    "size $(du -sh "$APP_DIR" | cut -f1) ($(find "$APP_DIR" -type f | wc -l) files)"

if [ "${SKIP_SELF_TEST:-0}" = "1" ]; then
    exit 0
fi
export PAGEDCHAT_CACHE_DIR=${PAGEDCHAT_CACHE_DIR:-$PWD/build/selftest-cache}
mkdir -p "$PAGEDCHAT_CACHE_DIR"
# Headless: no display, the offscreen Qt platform; the user's chats are never touched (the
# self-test uses a temporary data folder). The app preloads OpenBLAS itself when present.
env -u DISPLAY -u WAYLAND_DISPLAY -u LD_PRELOAD QT_QPA_PLATFORM=offscreen \
    "$APP_DIR/PagedChat" --self-test
echo "build_linux: frozen self-test passed in $(($(date +%s) - built)) s"
