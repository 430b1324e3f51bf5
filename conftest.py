"""The lessons' kernel for `make test`: with `--nbval-kernel-name gpukit-lessons`, every lesson runs in a Python that
sees only what `pip install "gpukit[lessons]"` brings (tests/lessons_env.py), not the suite's own dev packages."""

import os
import shutil
import tempfile
from pathlib import Path

from tests import lessons_env


def pytest_configure(config):
    if getattr(config.option, "nbval_kernel_name", None) != lessons_env.KERNEL_NAME:
        return
    folder = Path(tempfile.mkdtemp(prefix="gpukit-lessons-env-"))
    config._lessons_env = folder
    data = lessons_env.kernel(folder, lessons_env.build(folder))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(data), os.environ.get("JUPYTER_PATH")]))


def pytest_unconfigure(config):
    folder = getattr(config, "_lessons_env", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
