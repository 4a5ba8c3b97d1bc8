#!/usr/bin/env bash
# `make setup`: what `echorl demo` needs and nothing more (the tests' extras and the network lab's
# system tools are `make setup-test`), one line per step with the seconds so far, so a first
# set-up that takes minutes is never silent.
# usage: scripts/setup.sh PYTHON VENV TORCH   (TORCH empty: keep the torch already in VENV)
set -euo pipefail
PY=${1:-python3} VENV=${2:-.venv} TORCH=${3-torch==2.13.0}
BIN=$VENV/bin
say() { printf 'setup %3d s  [%s/4] %s\n' "$SECONDS" "$1" "$2"; }
SECONDS=0
say 1 "build tools for py-libp2p's fastecdsa (a C compiler, the GMP headers)"
bash scripts/ensure-build-deps.sh
say 2 "virtualenv $VENV"
[ -x "$BIN/python" ] || "$PY" -m venv "$VENV"
"$BIN/pip" install -q --upgrade pip
if [ -n "$TORCH" ]; then
    say 3 "$TORCH, the CPU build (a large wheel; TORCH= keeps a torch already in $VENV)"
    "$BIN/pip" install -q "$TORCH"
else
    say 3 "torch: keeping the one in $VENV ($("$BIN/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none))"
fi
say 4 "echorl, its dependencies and the plot extra (fastecdsa is compiled: a minute or two)"
"$BIN/pip" install -q -e '.[plot]'
printf 'setup %3d s  done: %s/echorl\n' "$SECONDS" "$BIN"
