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
# Set-up, the `package` extra and the deterministic inputs (pinned versions, PYTHONHASHSEED,
# SOURCE_DATE_EPOCH) come from packaging/build_common.sh, shared with build_macos.sh. Fast:
# PyInstaller's work folder (build/pyinstaller) is kept so unchanged binaries are not redone.
set -euo pipefail
cd "$(dirname "$0")/.."

DIST=dist
WORK=build/pyinstaller
APP_DIR=$DIST/PagedChat

source packaging/build_common.sh  # set-up, the package extra, PY, deterministic inputs

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
self_test_cache
# Headless: no display, the offscreen Qt platform; the user's chats are never touched (the
# self-test uses a temporary data folder). The app preloads OpenBLAS itself when present.
env -u DISPLAY -u WAYLAND_DISPLAY -u LD_PRELOAD QT_QPA_PLATFORM=offscreen \
    "$APP_DIR/PagedChat" --self-test
echo "build_linux: frozen self-test passed in $(($(date +%s) - built)) s"
