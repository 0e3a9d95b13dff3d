#!/usr/bin/env bash
# Build PagedChat.app and a .dmg on a Mac (Apple silicon, macOS 14+), from packaging/pagedchat.spec.
#
#   packaging/build_macos.sh                      ad-hoc signed app + dmg (runs on this Mac)
#   SIGN_IDENTITY="Developer ID Application: Name (TEAMID)" packaging/build_macos.sh
#                                                 Developer ID signature, hardened runtime
#   SIGN_IDENTITY=... NOTARY_PROFILE=pagedchat packaging/build_macos.sh
#                                                 ... then notarize and staple the dmg
#   SKIP_SELF_TEST=1 ...                          do not run the bundled app's --self-test
#   REGEN_ICON=1 ...                              remake resources/PagedChat.icns with iconutil
#
# NOTARY_PROFILE names credentials stored once with
#   xcrun notarytool store-credentials pagedchat --apple-id you@example.com --team-id TEAMID
# (an app-specific password), so no secret ever appears in this script or its environment.
#
# Written for macOS but not run here (no Mac on the build machines; see packaging/README.md):
# the Linux script runs the same spec and the same self-test in CI.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" != "Darwin" ]; then
    echo "build_macos: run this on a Mac (PyInstaller cannot cross-build); on Linux use" \
        "packaging/build_linux.sh" >&2
    exit 2
fi
if [ "$(uname -m)" != "arm64" ]; then
    echo "build_macos: MLX needs Apple silicon (arm64); this Mac is $(uname -m)" >&2
    exit 2
fi

APP=dist/PagedChat.app
ENTITLEMENTS=packaging/entitlements.plist

source packaging/build_common.sh  # set-up, the package extra, PY, deterministic inputs
VERSION=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
DMG=dist/PagedChat-$VERSION.dmg

if [ "${REGEN_ICON:-0}" = "1" ] || [ ! -f resources/PagedChat.icns ]; then
    "$PY" packaging/make_icon.py --iconutil  # Apple's iconutil: the full set of sizes
fi

start=$(date +%s)
rm -rf "$APP" dist/PagedChat
"$PY" -m PyInstaller --noconfirm --log-level WARN \
    --workpath build/pyinstaller-macos --distpath dist packaging/pagedchat.spec
echo "build_macos: built $APP in $(($(date +%s) - start)) s; size $(du -sh "$APP" | cut -f1)"

# Sign. --deep signs every nested library and the Python framework pieces PyInstaller laid
# out in Contents/Frameworks; a Developer ID signature also needs the hardened runtime
# (--options runtime), a secure timestamp and our entitlements for notarization.
if [ -n "${SIGN_IDENTITY:-}" ]; then
    codesign --force --deep --options runtime --timestamp \
        --entitlements "$ENTITLEMENTS" --sign "$SIGN_IDENTITY" "$APP"
else
    codesign --force --deep --sign - "$APP"  # ad hoc: runs on this Mac only
fi
codesign --verify --deep --strict --verbose=2 "$APP"

if [ "${SKIP_SELF_TEST:-0}" != "1" ]; then
    self_test_cache
    # The real executable inside the bundle, with the bundle's layout (Contents/Frameworks,
    # Contents/Resources) and its signature: model, Metal generation, window, resources.
    "$APP/Contents/MacOS/PagedChat" --self-test
fi

# The disk image: the app next to a link to /Applications, compressed (UDZO).
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
cp -R "$APP" "$staging/"
ln -s /Applications "$staging/Applications"
rm -f "$DMG"
hdiutil create -volname "PagedChat $VERSION" -srcfolder "$staging" -ov -format UDZO "$DMG"
if [ -n "${SIGN_IDENTITY:-}" ]; then
    codesign --force --timestamp --sign "$SIGN_IDENTITY" "$DMG"
fi

if [ -n "${NOTARY_PROFILE:-}" ]; then
    if [ -z "${SIGN_IDENTITY:-}" ]; then
        echo "build_macos: notarization needs a Developer ID signature (SIGN_IDENTITY)" >&2
        exit 1
    fi
    xcrun notarytool submit "$DMG" --keychain-profile "$NOTARY_PROFILE" --wait
    xcrun stapler staple "$DMG"
    xcrun stapler validate "$DMG"
    spctl --assess --type open --context context:primary-signature --verbose "$DMG"
fi
echo "build_macos: $APP and $DMG ready"
