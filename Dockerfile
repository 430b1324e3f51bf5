# gpukit in a container for clusters (Kubernetes, Slurm with enroot/pyxis): an official PyTorch CUDA
# image, with gpukit installed exactly as the README installs it.
#
#   docker build -t ghcr.io/your-org/gpukit:latest .
#   docker run --gpus all --rm ghcr.io/your-org/gpukit:latest          # runs `gpukit doctor`
#   docker push ghcr.io/your-org/gpukit:latest                         # where your cluster can pull it
#
# PYTORCH_IMAGE: a tag of https://hub.docker.com/r/pytorch/pytorch with torch >= 2.11 (what
# pyproject.toml asks for; an older torch would be replaced by a large download) and a CUDA
# version your cluster's driver supports (`gpukit doctor` warns when it does not).
ARG PYTORCH_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${PYTORCH_IMAGE}

WORKDIR /opt/gpukit
COPY pyproject.toml README.md ./
COPY gpukit ./gpukit
COPY examples ./examples
ENV PIP_NO_CACHE_DIR=1
RUN pip install -e ".[lab]"

# Datasets and checkpoints belong on a mounted volume (/shared in examples/cluster), not in the image.
CMD ["gpukit", "doctor"]
