"""torchvision's image I/O and transforms, imported on first use.

Importing torchvision costs about a second (its detection ops import torch._dynamo), which `import gpukit`
should not pay in a lesson that never decodes an image. `io()` is torchvision.io, `v2()` is
torchvision.transforms.v2; import them once per call site that needs them.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["io", "v2"]


def io() -> ModuleType:
    return importlib.import_module("torchvision.io")


def v2() -> ModuleType:
    return importlib.import_module("torchvision.transforms.v2")
