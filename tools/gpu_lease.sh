#!/usr/bin/env bash
# One short GPU lease, in two steps, from the checkout's root (.whl/ made by tools/gpu_wheels.sh):
#   bash tools/gpu_lease.sh prepare [TOTAL]   HERE, just before the call: writes .whl/lease.json (the commit, and what
#                                             changed since each commit the ledger names: the device's copy of the
#                                             checkout has no .git) and prints the plan the device will run
#   bash tools/gpu_lease.sh [TOTAL]           THERE: the device command, with .whl carried
#   python3 -m gpukit gpu-check --collect DIR back here, DIR holding $OUT's files: RESULTS.md and the ledger
#
# TOTAL (default 540) is the whole command's hard deadline in seconds. A lent H200 gives 15 minutes of device time,
# its start (2-4 min) included, and stops a command at 10 minutes:
#   start 240 s + TOTAL 540 s + KILL_GRACE 20 s + files back and forth ~30 s = 830 s <= 900 s; 560 s <= 600 s.
# The script measures its own set-up (the wheels installed) and gives gpu-check --budget what is left of TOTAL less
# PYTHON_START (Python and torch starting before gpu-check's clock runs); gpu-check ends by its budget by itself, and
# `timeout` is the backstop: SIGTERM at TOTAL (gpu-check stops its item with all its processes, writes, exits), then
# SIGKILL KILL_GRACE seconds later. Every finished item is already in $OUT when an item ends (gpukit/gpulease.py).
# Exit code: gpu-check's (0, 1, 3, 4, 5), 124 where timeout stopped it, 2 or 6 where the set-up failed.
set -euo pipefail
cd "$(dirname "$0")/.."
KILL_GRACE=20  # seconds: gpu-check's stop (SIGINT to the item, 10 s, SIGKILL) and its last writing (1-2 s)
PYTHON_START=15  # seconds: python3, gpukit and torch imported before gpu-check starts its clock
SETUP_PLANNED=30  # seconds the prepare step plans for the set-up: 25 s measured on a busy 2-core CPU

if [[ ${1:-} == prepare ]]; then
  total=${2:-540}
  if ! compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_lease: no wheels in .whl/: run bash tools/gpu_wheels.sh first (it needs a package registry)" >&2
    exit 2
  fi
  python=${PYTHON:-python3}
  [[ -z ${PYTHON:-} && -x .venv/bin/python ]] && python=.venv/bin/python
  exec "$python" -m gpukit.gpulease prepare --budget $((total - SETUP_PLANNED - PYTHON_START)) --gpu "NVIDIA H200"
fi

total=${1:-540}
out=${OUT:-runs/gpu-lease}
SECONDS=0  # bash counts the seconds since
mkdir -p "$out"
if ! compgen -G ".whl/*.whl" >/dev/null; then
  echo "gpu_lease: no wheels in .whl/: run bash tools/gpu_wheels.sh on a machine with internet and carry .whl" >&2
  exit 2
fi
if [[ ! -f .whl/lease.json && ! -d .git ]]; then
  echo "gpu_lease: no .whl/lease.json and no .git here: run bash tools/gpu_lease.sh prepare before the call" >&2
  exit 2
fi
pip_log=/tmp/gpu-lease-pip.log
if ! python3 -m pip install -q --no-compile --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl \
  >"$pip_log" 2>&1; then
  echo "gpu_lease: installing the wheels failed after ${SECONDS} s, so nothing was run:" | tee "$out/setup.txt" >&2
  sed "/Running pip as the 'root' user/d" "$pip_log" | tail -n 5 | tee -a "$out/setup.txt" >&2
  exit 6
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# nbconvert's templates (gpukit.site) and the kernelspec are data files: --target puts them under share/jupyter,
# where Jupyter does not look unless told.
export JUPYTER_PATH=/tmp/site/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}
left=$((total - SECONDS))
budget=$((left - PYTHON_START))
if ((budget < 120)); then
  echo "gpu_lease: the set-up took ${SECONDS} s of ${total}: ${budget} s would be left for gpu-check" \
    "(120 at least); nothing was run" | tee "$out/setup.txt" >&2
  exit 6
fi
echo "gpu_lease: set up in ${SECONDS} s ($(ls .whl/*.whl | wc -l) wheels); gpu-check --budget ${budget}," \
  "stopped at ${left} s if still running" | tee "$out/setup.txt"
exec timeout --signal=TERM --kill-after="$KILL_GRACE" "$left" \
  python3 -m gpukit gpu-check --budget "$budget" --out "$out" --log-dir /tmp/gpu-lease-logs
