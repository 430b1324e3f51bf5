"""What the lessons import, tried in a fresh Python (`import_check`), and which torchvision goes with this torch.

gpukit's own dependencies, torchvision's compiled operators and image codecs run on a tiny tensor, and the `lessons`
extra. A torch/torchvision pair that does not belong together (a CPU torch beside a CUDA torchvision: "operator
torchvision::nms does not exist") fails there, and `torchvision_install_command` gives the pip command that installs
the torchvision made for this torch. A crash of that Python (a compiled library of the wrong build) is reported, not
suffered.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys


def torchvision_for(torch_version: str) -> str | None:
    """The torchvision release made for a torch 2.x release: 0.(x + 15). "2.14.1+cpu" → "0.29"; None for others."""
    found = re.match(r"2\.(\d+)", torch_version)
    return f"0.{int(found[1]) + 15}" if found else None


def torch_for(torchvision_version: str) -> str | None:
    """The torch release a torchvision 0.y (y >= 15) release was made for: 2.(y - 15). "0.28.0+cu130" → "2.13"."""
    found = re.match(r"0\.(\d+)", torchvision_version)
    return f"2.{int(found[1]) - 15}" if found and int(found[1]) >= 15 else None


def _build(version: str) -> str | None:
    """The build a PyTorch wheel's local version names: "2.14.1+cpu" → "cpu", "0.29.1+cu130" → "cu130"."""
    return version.partition("+")[2] or None


def torchvision_install_command(torch_version: str) -> str:
    """The pip command that installs the torchvision made for this torch (same release and build), torch untouched."""
    release, build = torchvision_for(torch_version), _build(torch_version)
    # PyTorch's own index serves each build under its name (whl/cpu, whl/cu130); PyPI's wheels carry no build name.
    index = f" --index-url https://download.pytorch.org/whl/{build}" if build else ""
    return f'pip install --force-reinstall --no-deps "torchvision=={release}.*"{index}'


# What the lessons import, as (label, Python statements): gpukit's own dependencies, torchvision's compiled operators
# (its _C library: the first to fail when torch and torchvision do not belong together) and its image codecs (its
# image library), then the `lessons` extra (LESSONS_EXTRA: without it only the lessons that need it stop).
IMPORT_CHECKS = {
    "torch": "import torch",
    "torchvision": "import torchvision",
    "torchvision.ops.nms": "assert torchvision.ops.nms(torch.ones(1, 4).cumsum(1), torch.ones(1), 0.5).tolist() == [0]",
    "torchvision.io.decode_jpeg": "torchvision.io.decode_jpeg(torchvision.io.encode_jpeg(torch.zeros(3, 8, 8).byte()))",
    "numpy": "import numpy",
    "matplotlib": "import matplotlib.pyplot",
    "ipywidgets": "import ipywidgets",
    "tqdm": "import tqdm.auto",
    "cloudpickle": "import cloudpickle",
    "yaml": "import yaml",
    "webdataset": "import webdataset",
    "tensorboard": "import torch.utils.tensorboard",
    "timm": "import timm",
    "torchao": "import torchao",
    "pynvml": "import pynvml",
}
LESSONS_EXTRA = ("yaml", "webdataset", "tensorboard", "timm", "torchao", "pynvml")
IMPORT_SECONDS = 300  # all of it took 8-15 s on two busy cores (timm and torchao ~10 s each alone, sharing most)


# Run in a fresh Python: one line per label as soon as it is known, so that a crash still names what it was trying.
_PROBE = """
import importlib.util, json, sys
failed = set()
for label, statement in json.loads(sys.argv[1]).items():
    if label.split(".")[0] in failed:  # torchvision's operators, where torchvision itself fails: said once
        continue
    print("trying " + label, flush=True)
    try:
        exec(statement)
        outcome = "ok"
    except ModuleNotFoundError as error:
        top = (error.name or "").split(".")[0]
        missing = top and importlib.util.find_spec(top) is None
        outcome = f"not installed ({top})" if missing else f"ModuleNotFoundError: {error}"
    except Exception as error:  # a probe: whatever a broken install raises (ImportError, OSError, RuntimeError, ...)
        first = str(error).strip().splitlines()[:1]
        outcome = type(error).__name__ + (": " + first[0][:300] if first else "")
    if outcome != "ok":
        failed.add(label)
    print("outcome " + json.dumps([label, outcome]), flush=True)
"""


def import_check(seconds: float = IMPORT_SECONDS) -> tuple[dict[str, str], str]:
    """(label → outcome for IMPORT_CHECKS, "ok" or why the check gave no answer), from a fresh Python.

    A fresh process, as a lesson's kernel: a broken library can neither leave this one half-imported nor crash it,
    and CUDA stays untouched here. torchvision's checks are skipped where torchvision itself fails."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, json.dumps(IMPORT_CHECKS)],
            capture_output=True,
            text=True,
            timeout=seconds,
        )
    except subprocess.TimeoutExpired as error:
        found, trying = _probe_lines(error.stdout)
        return found, f"did not finish in {seconds:.0f} s (it was importing {trying})"
    found, trying = _probe_lines(done.stdout)
    if trying is not None:  # the process died on it: a segmentation fault in a compiled library, say
        found[trying] = f"crashed the Python process (exit code {done.returncode})"
    return found, "ok"


def _probe_lines(stdout: str | bytes | None) -> tuple[dict[str, str], str | None]:
    """The outcomes the probe printed, and the label it was trying when it stopped (None: it finished)."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout or ""
    found, trying = {}, None
    for line in text.splitlines():
        if line.startswith("trying "):
            trying = line[len("trying ") :]
        elif line.startswith("outcome "):
            label, outcome = json.loads(line[len("outcome ") :])
            found[label], trying = outcome, None
    return found, trying
