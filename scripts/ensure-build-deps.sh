#!/usr/bin/env bash
# py-libp2p 0.8.1 builds `fastecdsa` from source: it needs a C compiler and the GMP headers.
# Install them with apt when they are missing and we are allowed to; otherwise say what to do.
# The network lab (tests/netlab.py, bench/netlab.py) also needs iproute2 and nftables; as root
# with apt they are installed too (the lab tests skip, saying why, where they are missing).
set -euo pipefail
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && { ! command -v nft >/dev/null || ! command -v tc >/dev/null; }; then
    echo "installing iproute2 and nftables (for the network lab tests)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables >/dev/null || \
        echo "warning: could not install iproute2/nftables; the network lab tests will be skipped" >&2
fi
have_gmp() { [ -f /usr/include/gmp.h ] || ls /usr/include/*/gmp.h >/dev/null 2>&1; }
if command -v cc >/dev/null && have_gmp; then exit 0; fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing a C compiler and libgmp headers (needed to build fastecdsa)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential libgmp-dev python3-dev >/dev/null
elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential libgmp-dev python3-dev >/dev/null
else
    echo "error: need a C compiler and GMP headers (Debian: apt-get install build-essential libgmp-dev)" >&2
    exit 1
fi
