#!/usr/bin/env bash
# Builds the last zdelay that runs on storage layout 1 and prints the path of its binary.
#
#   bash scripts/pinned-zdelay.sh
#
# `zdelay upgrade` moves a layout-1 namespace to route lanes while the older release's
# daemons and producers keep running; this build cannot create or serve layout 1 any more,
# so the upgrade's tests run that older zdelay beside it. It is built from this repository's
# own history (commit PIN, the last one that serves layout 1 and follows a live upgrade),
# into the same target directory, so the dependencies' build is shared and only the two
# workspace crates compile (about four minutes once; the binary is kept under target/pinned
# and in ${ZDELAY_CACHE:-~/.cache/zdelay}/pinned, where a new clone finds it).
# Needs a clone with history (not a shallow one).
set -euo pipefail

PIN=df3d58ca58ace1a52b860370f803b2f73af426a5
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT=$PWD
OUT=$ROOT/target/pinned/zdelay-${PIN:0:7}
# Also kept beside the suite's other built tools (tansu, mdBook), so a new clone on a machine
# that built it once skips the four-minute build. Its sources are one fixed commit.
CACHED=${ZDELAY_CACHE:-$HOME/.cache/zdelay}/pinned/zdelay-${PIN:0:7}
if [[ ! -x $OUT && -x $CACHED ]]; then
    mkdir -p "$ROOT/target/pinned"
    cp "$CACHED" "$OUT.tmp"
    mv "$OUT.tmp" "$OUT"
fi
keep_in_cache() {
    [[ -x $CACHED ]] && return
    mkdir -p "$(dirname "$CACHED")"
    cp "$OUT" "$CACHED.tmp.$$"
    mv "$CACHED.tmp.$$" "$CACHED"
}
if [[ -x $OUT ]]; then
    keep_in_cache
    echo "$OUT"
    exit 0
fi
if ! git cat-file -e "$PIN^{commit}" 2>/dev/null; then
    echo "scripts/pinned-zdelay.sh: commit $PIN is not in this clone (a shallow clone?):" \
        "run git fetch --unshallow, then again" >&2
    exit 1
fi
# Outside the target directory, and deleted afterwards: cargo records the sources it built
# from, and a record of files that stay (with the commit's old times) would pass for fresh.
SRC=$(mktemp -d "${TMPDIR:-/tmp}/zdelay-pinned.XXXXXX")
trap 'rm -rf "$SRC"' EXIT
mkdir -p "$ROOT/target/pinned"
git archive "$PIN" | tar -x -C "$SRC"
# Cargo names a workspace crate's artifacts without its path, and the extracted files carry
# the commit's old times: built as they are, the two trees would take each other's
# artifacts for fresh. Another profile for the pinned crates gives them their own (the
# dependencies' stay shared).
cat >>"$SRC/Cargo.toml" <<'TOML'

[profile.dev.package.zdelay]
debug = false

[profile.dev.package.zdelay-core]
debug = false
TOML
# Building a binary also copies it to target/debug/zdelay; the next build of this tree puts
# its own back (cargo copies a binary out even when nothing was rebuilt).
CARGO_TARGET_DIR=$ROOT/target cargo build --locked --quiet --manifest-path "$SRC/Cargo.toml" \
    -p zdelay --bin zdelay --features test-failpoints >&2
cp "$ROOT/target/debug/zdelay" "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
keep_in_cache
echo "$OUT"
