#!/usr/bin/env bash
# One fresh lent GPU machine, one command (from the checkout's root, .whl/ made by tools/gpu_wheels.sh carried):
#   bash tools/gpu_lease.sh [BUDGET]     # BUDGET: gpu-check's seconds, default 480 (a 15-minute lease)
# Installs the wheels into /tmp/site (seconds: no dependency resolution, no bytecode compiling), then runs
# `gpu-check --budget BUDGET --out $OUT`: what the ledger says is due, most valuable first, packed into BUDGET.
# $OUT then holds summary.txt, results.md, gpu-ledger.json and logs.tar.gz; back on your machine
#   python3 -m gpukit gpu-check --collect DIR    # DIR: where $OUT's files came back
# appends results.md to benchmarks/RESULTS.md and merges the ledger. Exit code: gpu-check's (0, 1, 3 or 4).
set -euo pipefail
cd "$(dirname "$0")/.."
budget=${1:-480}
out=${OUT:-runs/gpu-lease}
mkdir -p "$out"
SECONDS=0  # bash counts the seconds since
if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "gpu_lease: no wheels in .whl/: run bash tools/gpu_wheels.sh on a machine with internet and carry .whl" >&2
  exit 2
fi
python3 -m pip install -q --no-compile --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 \
  | grep -v -e "Running pip as the 'root' user" -e "is ignored" || true
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# nbconvert's templates (gpukit.site) and the kernelspec are data files: --target puts them under share/jupyter,
# where Jupyter does not look unless told.
export JUPYTER_PATH=/tmp/site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
echo "gpu_lease: set up in ${SECONDS} s ($(ls .whl/*.whl | wc -l) wheels)" | tee "$out/setup.txt"
python3 -m gpukit gpu-check --budget "$budget" --out "$out"
