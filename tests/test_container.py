"""The container image for clusters, checked statically: it cannot be built here (no registry)."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
CLUSTER = ROOT / "examples" / "cluster"


def _readme_install() -> str:
    found = re.search(r"`(pip install -e \"\.\[[^\]]+\]\")`", (ROOT / "README.md").read_text())
    assert found, "the README no longer says how it installs gpukit"
    return found.group(1)


def _built_tag() -> str:
    found = re.search(r"docker build -t (\S+) \.", (CLUSTER / "README.md").read_text())
    assert found, "examples/cluster/README.md no longer says how to build the image"
    return found.group(1)


def test_dockerfile_starts_from_an_official_pytorch_cuda_image():
    base = re.search(r"^ARG PYTORCH_IMAGE=(\S+)", DOCKERFILE, re.MULTILINE).group(1)
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-(runtime|devel)", base), base
    assert re.search(r"^FROM \$\{PYTORCH_IMAGE\}$", DOCKERFILE, re.MULTILINE)
    torch_needed = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    version = tuple(int(part) for part in base.split(":")[1].split("-")[0].split("."))
    assert version >= tuple(int(part) for part in torch_needed.split(".")), "the base image's torch is too old"


def test_dockerfile_installs_gpukit_the_readme_way():
    runs = re.findall(r"^RUN (.+)$", DOCKERFILE, re.MULTILINE)
    assert any(_readme_install() in run for run in runs), runs
    copied = re.findall(r"^COPY (\S+)", DOCKERFILE, re.MULTILINE)
    assert {"pyproject.toml", "gpukit"} <= set(copied), "pip install -e needs the project files in the image"


def test_the_job_files_run_the_image_the_readme_builds():
    tag = _built_tag()
    assert tag in DOCKERFILE  # the Dockerfile's own build line
    images = re.findall(r"image:\s*(\S+)", (CLUSTER / "pytorchjob.yaml").read_text())
    assert images == [tag], images
    registry, _, path = tag.partition("/")
    assert f"--container-image={registry}#{path}" in (CLUSTER / "slurm.sbatch").read_text()  # pyxis syntax
