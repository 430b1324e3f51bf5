#!/usr/bin/env bash
# Download the wheels of tools/gpu-wheels.txt for an offline x86-64 Linux GPU machine with Python 3.12 (the lent
# H100/H200 image), from a machine with internet, at the checkout's root:
#   bash tools/gpu_wheels.sh [DEST]        # DEST defaults to .whl (git-ignored)
# On the GPU machine, tools/gpu_lease.sh installs them in seconds (pip --no-index --no-deps --target); before each
# call, `bash tools/gpu_lease.sh prepare` adds .whl/lease.json (the commit: the device's copy has no .git).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
names=$(sed 's/#.*//' tools/gpu-wheels.txt | tr -s ' \n' ' ')
platforms=""
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_17 manylinux2014 manylinux1; do
  platforms="$platforms --platform ${tag}_x86_64"
done
# One pip call for all: a name pip cannot find stops it, naming the package.
# shellcheck disable=SC2086  # word splitting wanted: names and platforms are lists
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $platforms -d "$dest" $names
echo "$(ls "$dest"/*.whl | wc -l) wheels in $dest, $(du -sh "$dest" | cut -f1)"
