#!/usr/bin/env bash
# `make setup-test`: the network lab (tests/netlab.py, bench/netlab.py) needs iproute2 and nftables.
# As root with apt they are installed; elsewhere the lab tests skip, saying why. Not part of the
# demo's set-up: `make demo` never runs a system package manager for them.
set -euo pipefail
if command -v nft >/dev/null && command -v tc >/dev/null; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup-test: installing iproute2 and nftables (for the network lab tests)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables >/dev/null || \
        echo "warning: could not install iproute2/nftables; the network lab tests will be skipped" >&2
else
    echo "setup-test: no iproute2/nftables (not root with apt): the network lab tests will be skipped" >&2
fi
