"""Imported by Python at start-up where this folder is on PYTHONPATH: only in the kernels of mutant runs
(tests/mutants.py puts it there). Applies the mutant named in GPUKIT_MUTANT before the lesson's first cell and
notes it in GPUKIT_MUTANT_CALLS; the runner reports a run whose log lacks that note as crashed, never as
survived (Python prints an error in sitecustomize and goes on)."""

import importlib.util
import os
import sys
from pathlib import Path

if os.environ.get("GPUKIT_MUTANT"):
    _path = Path(__file__).resolve().parent.parent / "mutations.py"
    _spec = importlib.util.spec_from_file_location("gpukit_mutations", _path)
    _mutants = sys.modules["gpukit_mutations"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
    _spec.loader.exec_module(_mutants)
    _log = _mutants.CallLog(os.environ.get("GPUKIT_MUTANT_CALLS"))
    _mutants.apply(os.environ["GPUKIT_MUTANT"], _log)
    _log.note(f"applied {os.environ['GPUKIT_MUTANT']}")
