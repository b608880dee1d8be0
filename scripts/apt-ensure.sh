#!/usr/bin/env bash
# Installs Debian packages for commands that are missing; does nothing when all are there.
#
#   bash scripts/apt-ensure.sh redis-server:redis-server redis-cli:redis-tools curl:curl
#
# Each argument is COMMAND:PACKAGE; an absolute path as COMMAND counts as present when the file
# exists (headers: /usr/include/openssl/ssl.h:libssl-dev). Runs `apt-get update` once, then one quiet,
# noninteractive `apt-get install` of the missing packages (as root, or through `sudo -n`).
# The install does not start system services (a temporary policy-rc.d), so no system Redis
# appears on 6379: the project's scripts and tests start their own on free ports.
set -euo pipefail

missing=()
for pair in "$@"; do
    cmd=${pair%%:*}
    pkg=${pair#*:}
    if [[ $cmd == /* && -e $cmd ]]; then
        continue
    fi
    if ! command -v "$cmd" >/dev/null 2>&1; then
        missing+=("$pkg")
    fi
done
((${#missing[@]} == 0)) && exit 0

SUDO=()
if ((EUID != 0)); then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "apt-ensure: missing ${missing[*]} and not root: apt-get install ${missing[*]}" >&2
        exit 1
    fi
    SUDO=(sudo -n)
fi

echo "apt-ensure: installing ${missing[*]} (apt-get update + install, a few seconds)"
export DEBIAN_FRONTEND=noninteractive
added_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee /usr/sbin/policy-rc.d >/dev/null
    "${SUDO[@]}" chmod +x /usr/sbin/policy-rc.d
    added_policy=1
fi
rc=0
{
    "${SUDO[@]}" apt-get update -qq &&
        "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
            -o DPkg::Lock::Timeout=120 "${missing[@]}" >/dev/null
} || rc=$?
if ((added_policy)); then
    "${SUDO[@]}" rm -f /usr/sbin/policy-rc.d
fi
if ((rc != 0)); then
    echo "apt-ensure: apt-get install ${missing[*]} failed (exit $rc)" >&2
    exit "$rc"
fi
for pair in "$@"; do
    cmd=${pair%%:*}
    [[ $cmd == /* && -e $cmd ]] && continue
    command -v "$cmd" >/dev/null 2>&1 || {
        echo "apt-ensure: $cmd still missing after installing ${missing[*]}" >&2
        exit 1
    }
done
