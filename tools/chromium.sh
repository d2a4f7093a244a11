#!/usr/bin/env bash
# Installs Debian's `chromium` (and a font for its text) when missing, for
# the chat page test crates/moeflux-server/tests/api/chromium.rs; uses sudo only
# when not root. Prints the browser's path. About 20 s on a fresh machine.
set -euo pipefail
if ! command -v chromium >/dev/null || [[ ! -e /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ]]; then
    sudo=()
    [[ $(id -u) == 0 ]] || sudo=(sudo)
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
command -v chromium
