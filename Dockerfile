# robez service image: `docker build -t robez .` then `docker run -p 8000:8000 --shm-size=1g robez`
# (or `docker compose up`). CPU only: torch comes from PyTorch's CPU wheel index, so the image carries
# no CUDA libraries.
#
# Build arguments, for machines that reach neither Docker Hub nor PyTorch's index (`docker build .` with
# none keeps the defaults):
#   PYTHON_IMAGE    base of both stages (default python:3.11-slim); any Debian-like image with Python 3.11
#                   as `python`, its `venv` module, `groupadd` and `useradd`
#   TORCH_PIP_ARGS  where pip finds torch (default PyTorch's CPU index). Without that index, copy the
#                   torch-2.13.0+cpu cp311 wheel into deploy/wheels/ and pass
#                   --build-arg TORCH_PIP_ARGS="--find-links deploy/wheels" (torch's dependencies: PyPI)
# `make container-test` uses both (docs/deploy.md).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# torch first, from the CPU index: the pin in constraints.txt (torch==2.13.0) also matches
# 2.13.0+cpu, so the second install keeps it instead of pulling the CUDA build from PyPI.
COPY constraints.txt ./
COPY deploy/wheels ./deploy/wheels
RUN pip install ${TORCH_PIP_ARGS} "torch==2.13.0+cpu"

COPY pyproject.toml README.md ./
COPY robez_core ./robez_core
COPY service ./service
RUN pip install -c constraints.txt . \
    && python -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"


FROM ${PYTHON_IMAGE}

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    # numba's cache=True cannot write next to the read-only installed package; compiled kernels go here.
    NUMBA_CACHE_DIR=/home/robez/.cache/numba \
    ROBEZ_PORT=8000

RUN groupadd --system --gid 10001 robez \
    && useradd --system --uid 10001 --gid robez --create-home --home-dir /home/robez robez \
    && mkdir -p /data /config \
    && chown robez:robez /data
COPY --from=build /opt/venv /opt/venv

USER robez
WORKDIR /home/robez
VOLUME ["/data"]
EXPOSE 8000

# slim has no curl: probe with the interpreter. urlopen raises (exit 1) on refusal, timeout or non-2xx.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('ROBEZ_PORT', '8000') + '/healthz', timeout=4)"]

CMD ["robez", "serve", "--host", "0.0.0.0", "--data-dir", "/data"]
