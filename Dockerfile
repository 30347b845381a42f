# syntax=docker/dockerfile:1
# The image cluster/kuberay-rayservice.yaml runs (every Ray pod: head, routers, GPU workers):
# Ray 2.60 on CUDA (Ray's own image, which KubeRay's probes and `ray start` expect), a CUDA build
# of torch, and this package installed in place at /home/ray/specserve.
#
#   make image                        # docker build -t specserve:0.1.0 .
#   docker tag specserve:0.1.0 REGISTRY/specserve:0.1.0 && docker push REGISTRY/specserve:0.1.0
#   # then set `image:` in cluster/kuberay-rayservice.yaml to REGISTRY/specserve:0.1.0
#
# The tag is the package version (pyproject.toml); tests/unit/test_dockerfile.py checks it, the
# base image's Ray version and Python against pyproject.toml and the manifests.
# TORCH_INDEX picks the CUDA build: cu128 needs an NVIDIA driver >= 570 on the GPU nodes.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

LABEL org.opencontainers.image.title="specserve" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="Speculative decoding served as a Ray Serve application"

# Hugging Face downloads go to the model cache volume the RayService mounts here (see
# cluster/kuberay-rayservice.yaml); without a volume they land in the container's own layer.
ENV HF_HOME=/home/ray/model-cache/huggingface \
    PYTHONUNBUFFERED=1

# torch first, from the CUDA index: the package's `torch>=2.4` is then already satisfied and pip
# keeps this build instead of fetching the CPU wheel from PyPI.
RUN pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

WORKDIR /home/ray/specserve
# Dependencies before the source, so a code change rebuilds only the last layers: install the
# package once from its metadata alone (pulls every runtime dependency, no [test] extra), then
# again without dependencies once the source is in (the editable install now maps its packages).
COPY --chown=ray:users pyproject.toml README.md ./
RUN pip install --no-cache-dir -e . && mkdir -p /home/ray/model-cache/huggingface
COPY --chown=ray:users app ./app
COPY --chown=ray:users deployments ./deployments
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users configs ./configs
COPY --chown=ray:users models ./models
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import torch, ray, deployments.builder; assert ray.__version__ == '2.60.0', ray.__version__"
