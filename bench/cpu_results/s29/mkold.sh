#!/bin/bash
# usage: mkold.sh COMMIT DEST -> DEST/radixlm, an importable copy of the package at COMMIT
# (PYTHONPATH=DEST puts it before the editable install of the working tree).
set -e
src=$(mktemp -d)
rm -rf "$2"; mkdir -p "$2"
git archive "$1" | tar -x -C "$src"
cp -r "$src/radixlm_pkg" "$2/radixlm"
for sub in runtime radix kernels frontend; do cp -r "$src/$sub" "$2/radixlm/$sub"; done
rm -rf "$src"
