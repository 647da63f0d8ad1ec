# The decider worker image: CUDA PyTorch base + decider. Build: docker compose build (or docker build -t decider .)
# The base pins the CUDA torch build; pip keeps it because it satisfies decider's torch range.
ARG BASE_IMAGE=pytorch/pytorch:2.7.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/decider
COPY pyproject.toml ./
COPY engine ./engine
COPY worker ./worker
COPY schemas ./schemas
# pyproject names README.md as the package's readme.
COPY README.md ./
RUN pip install ".[gpu]" || pip install .

# A non-root user; the model directory is mounted read-only at /models/model.
RUN useradd --create-home decider
USER decider
ENTRYPOINT []
CMD ["decider", "--help"]
