#!/usr/bin/env bash
# The wheels a GPU lease machine needs for scripts/gpu_train_drafters.py: its image has transformers 5.17 and
# huggingface_hub 1.33 and no network; dspark_hf needs transformers >= 5.24 (and the GGUF reader for the target).
# Writes them to .whl/ (git-ignored through .git/info/exclude); on the machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:src
# Checked in an emulation of that image (Python 3.12, transformers 5.17, hub 1.33, no httpx2): without kernels,
# from_pretrained raises "Kernels are not available"; without httpx2/httpcore2/truststore, huggingface_hub 2.4 does
# not import. About 17.7 MB.
set -euo pipefail
dest="${1:-.whl}"
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  kernels==0.19.1 tomlkit==0.15.3 gguf==0.19.0
ls -la "$dest"
