#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels tools/gpu_check.py needs on the lent GPU machine, which
# has torch, transformers, safetensors, msgpack and pytest but neither these nor a network.
# CPython 3.10-3.12 on x86_64 Linux, since the machine's Python version is not known in advance.
# Run where pip reaches a registry, from the repository root. About 15 MiB.
set -euo pipefail
PYTHON=${PYTHON:-python3}  # its pip must reach a registry; the DeepSpeed build also needs its torch
cd "$(dirname "$0")/.."
for version in 3.10 3.11 3.12; do
  "$PYTHON" -m pip download --only-binary=:all: --python-version "$version" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl pydantic pydantic-core annotated-types typing-extensions typing-inspection pyyaml pyzmq \
    hjson ninja psutil py-cpuinfo einops  # DeepSpeed's own requirements
done
# DeepSpeed publishes only an sdist; its wheel (no prebuilt ops) is pure Python. Needs torch here.
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w .whl "deepspeed==0.19.8"
du -sh .whl
