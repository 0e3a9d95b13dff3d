#!/usr/bin/env bash
# A fingerprint of the code the GPU check runs (engine/, shaders/, scripts/gpu/ sources): the
# device machine gets a copy of the working tree whose git metadata is stale, so its own
# `git rev-parse` names the wrong commit (session 24's check printed a hash two sessions old).
# Run here on a clean checkout, it prints the same id for the same code as on the device.
cd "$(dirname "$0")/../.." || exit 1
find engine shaders scripts/gpu -type f \( -name '*.py' -o -name '*.cu' -o -name '*.metal' \
    -o -name '*.cpp' -o -name '*.h' -o -name '*.sh' \) -print0 | LC_ALL=C sort -z \
    | xargs -0 sha1sum | sha1sum | cut -c1-12
