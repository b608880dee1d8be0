#!/usr/bin/env bash
# The aarch64 (arm64) Linux binary, cross-built on an x86_64 Debian machine.
#
#   bash scripts/cross-aarch64.sh setup    Debian's arm64 cross toolchain (gcc, binutils), the
#                                          arm64 OpenSSL and zlib headers (multiarch), qemu-user-static
#                                          to run the result, and Rust's aarch64 standard
#                                          library (rustup); once, then a stamp says it is done
#   bash scripts/cross-aarch64.sh build    cargo build --release --locked of the zdelay binary for
#                                          aarch64-unknown-linux-gnu; prints the binary's path
#   bash scripts/cross-aarch64.sh run ARGS the binary under qemu-aarch64-static, on the arm64 libraries
#                                          installed beside the host's (multiarch)
#
# The build directory is kept under the cache ($ZDELAY_CACHE, else ~/.cache/zdelay), like the
# suite's other tool builds: a clean clone compiles only zdelay's own crates for aarch64 (the
# first build on a machine compiles every dependency, about 10 minutes on 2 cores).
# librdkafka is compiled by its crate's build script with ./configure, which takes the C
# compiler from CC: CC names the cross compiler, and CC_x86_64_unknown_linux_gnu keeps the
# host's build scripts on the host compiler.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
CACHE=${ZDELAY_CACHE:-$HOME/.cache/zdelay}
TRIPLE=aarch64-unknown-linux-gnu
CROSS_TARGET=${ZDELAY_CROSS_TARGET:-$CACHE/cross-target}
PACKAGES=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu binutils-aarch64-linux-gnu libc6-dev-arm64-cross libssl-dev:arm64
    zlib1g-dev:arm64 qemu-user-static)

die() { printf 'cross-aarch64.sh: %s\n' "$*" >&2; exit 1; }

setup() {
    [[ $(uname -m) == x86_64 ]] || die "cross-builds from x86_64 only (on arm64, build natively)"
    local stamp=$CACHE/.cross-aarch64-stamp want
    want="${PACKAGES[*]} $(rustc --version)"
    if [[ $(cat "$stamp" 2>/dev/null) == "$want" ]]; then return; fi
    if ! dpkg --print-foreign-architectures | grep -qx arm64; then
        dpkg --add-architecture arm64
        apt-get update -q >/dev/null
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >/dev/null ||
        { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
            --no-install-recommends "${PACKAGES[@]}" >/dev/null; } || die "apt-get install of ${PACKAGES[*]} failed"
    rustup target add "$TRIPLE" >/dev/null 2>&1 || die "rustup target add $TRIPLE failed"
    mkdir -p "$CACHE"
    echo "$want" >"$stamp"
}

build() {
    export CARGO_TARGET_DIR=$CROSS_TARGET
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
    export CC=aarch64-linux-gnu-gcc CXX=aarch64-linux-gnu-g++ AR=aarch64-linux-gnu-ar
    export CC_aarch64_unknown_linux_gnu=$CC CXX_aarch64_unknown_linux_gnu=$CXX AR_aarch64_unknown_linux_gnu=$AR
    export CC_x86_64_unknown_linux_gnu=gcc CXX_x86_64_unknown_linux_gnu=g++ AR_x86_64_unknown_linux_gnu=ar
    export PKG_CONFIG_ALLOW_CROSS=1 PKG_CONFIG_LIBDIR=/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig
    cargo build --release --locked --target "$TRIPLE" --bin zdelay --quiet >&2
    echo "$CROSS_TARGET/$TRIPLE/release/zdelay"
}

case ${1:-} in
    setup) setup ;;
    build) build ;;
    run) shift; exec qemu-aarch64-static "$CROSS_TARGET/$TRIPLE/release/zdelay" "$@" ;;
    *) die "usage: $0 setup|build|run ARGS" ;;
esac
