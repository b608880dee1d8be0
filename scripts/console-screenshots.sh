#!/usr/bin/env bash
# Screenshots of each console page into docs/console/<page>.png: runs the browser test
# (tests/it/console.rs, console_in_a_real_browser: a daemon with seeded jobs, dead letters and
# schedules, driven by tests/it/py/console_browser.py in headless chromium), which saves them
# when ZDELAY_CONSOLE_SHOTS names a directory. Needs `bash scripts/services.sh install`.
set -euo pipefail
ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)
cd "$ROOT"
ZDELAY_CONSOLE_SHOTS="$ROOT/docs/console" cargo test --test it --features test-failpoints \
    -- --exact console::console_in_a_real_browser
ls -l docs/console/*.png
