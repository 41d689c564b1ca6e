# syntax=docker/dockerfile:1
# The embedded server's image: CPU torch, specbuild from this checkout, the nvidia-pytriton tritonserver made a
# plain `tritonserver` (docker/install_tritonserver.py), a non-root user (uid 1000, what the Kubernetes manifests of
# `specbuild deploy --kubernetes` run as). Build from the repository root:
#
#   docker build -f docker/embedded.Dockerfile -t REGISTRY/specbuild:0.1.0 .
#
# Health: Kubernetes ignores HEALTHCHECK and uses the manifests' startup/readiness/liveness probes on
# /v2/health/{live,ready}; the HEALTHCHECK below is for `docker run`.
FROM python:3.11.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# g++: the fused CPU decode step is compiled on first use (torch cpp_extension + ninja) into TORCH_EXTENSIONS_DIR.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# torch first, from the CPU index: the default index would pull a multi-GB CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

COPY . /tmp/specbuild-src
RUN pip install /tmp/specbuild-src \
    && python /tmp/specbuild-src/docker/install_tritonserver.py --backends /opt/tritonserver/backends --bin /usr/local/bin \
    && rm -rf /tmp/specbuild-src

RUN useradd --create-home --uid 1000 --user-group specbuild
USER 1000:1000
ENV HOME=/home/specbuild \
    SPECBUILD_CACHE=/home/specbuild/.cache/specbuild \
    TORCH_EXTENSIONS_DIR=/home/specbuild/.cache/torch_extensions
WORKDIR /home/specbuild

EXPOSE 8000 8001 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready', timeout=4)"]
ENTRYPOINT ["tritonserver"]
CMD ["--help"]
