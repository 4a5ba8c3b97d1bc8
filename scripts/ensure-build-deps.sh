#!/usr/bin/env bash
# py-libp2p 0.8.1 pins fastecdsa 2.3.2, which pip compiles from source: it needs a C compiler and
# the GMP headers. Where both are here (the usual case) this does nothing; otherwise it installs
# them with apt when allowed (root, or sudo) and says what to do when not. The network lab's
# system tools are not installed here (scripts/ensure-lab-deps.sh, `make setup-test`).
set -euo pipefail
have_gmp() { [ -f /usr/include/gmp.h ] || ls /usr/include/*/gmp.h >/dev/null 2>&1; }
if command -v cc >/dev/null && have_gmp; then exit 0; fi
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing a C compiler and the GMP headers (apt: build-essential libgmp-dev; to build fastecdsa)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential libgmp-dev python3-dev >/dev/null
elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential libgmp-dev python3-dev >/dev/null
else
    echo "error: need a C compiler and GMP headers (Debian: apt-get install build-essential libgmp-dev)" >&2
    exit 1
fi
