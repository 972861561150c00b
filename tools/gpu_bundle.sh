#!/usr/bin/env bash
# `make bench-gpu` on a bare GPU machine that has Python, torch and most of ComfyUI's requirements, but no ComfyUI,
# no models and no package index (a lent machine that receives only a copy of this checkout, 64 MiB at most).
#
#   tools/gpu_bundle.sh pack          # here, after `make setup`: writes .gpu/ (git-ignored, about 30 MB)
#   tools/gpu_bundle.sh run [OUT]     # there, in the copied checkout: unpacks, writes the models, runs bench/gpu.py
#   tools/gpu_bundle.sh with CMD...   # there: unpacks, then runs CMD with that ComfyUI (e.g. one bench script)
#
# .gpu/comfyui.tar.xz is the ComfyUI under test without its models or caches; .gpu/site.tar.xz holds, unpacked, the
# wheels of ComfyUI's imports that such a machine lacked on 2026-11-26 (Python 3.12, torch 2.11.0+cu130): PyAV and
# torchsde with its trampoline. xz, because PyAV's wheel alone is 36 MB. `run` writes gpu.md, its log and the Flux
# step's JSON into OUT (default docs/benchmarks/) and takes about 7 minutes on an H200 (2026-11-26, gpu_h200.md).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="av==18.1.0 torchsde==0.2.6 trampoline==0.1.2"
BUDGET="${GPU_BUDGET:-540}"  # bench/gpu.py's seconds for all its steps: a 10-minute call, less the unpacking and models

case "${1:-}" in
pack)
    comfy="${COMFYUI_DIR:-.comfyui/ComfyUI}"
    rm -rf .gpu && mkdir -p .gpu/wheels .gpu/site
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/wheels $WHEELS
    for wheel in .gpu/wheels/*.whl; do (cd .gpu/site && unzip -q -o "../../$wheel"); done
    tar -cJf .gpu/site.tar.xz -C .gpu/site .
    tar -cJf .gpu/comfyui.tar.xz -C "$(dirname "$(realpath "$comfy")")" --exclude='*.safetensors' --exclude='*.pt' \
        --exclude='*.pth' --exclude='*.ckpt' --exclude=accel_cache --exclude=accel-template-standins \
        --exclude=__pycache__ --exclude=.git --exclude=comfyui-accel --exclude=tests --exclude=tests-unit \
        --exclude='output/*' --exclude='temp/*' "$(basename "$(realpath "$comfy")")"
    rm -rf .gpu/wheels .gpu/site
    du -sh .gpu/*.tar.xz
    echo "then on the GPU machine, in a copy of this checkout that carries .gpu/: tools/gpu_bundle.sh run [OUT]"
    ;;
run | with)
    mkdir -p /tmp/accel-gpu-site .gpu/comfy
    tar -xJf .gpu/site.tar.xz -C /tmp/accel-gpu-site
    tar -xJf .gpu/comfyui.tar.xz -C .gpu/comfy
    export PYTHONPATH="/tmp/accel-gpu-site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    COMFYUI_DIR="$(realpath .gpu/comfy/*/)"
    export COMFYUI_DIR
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi here"
    if [ "$1" = with ]; then
        shift
        exec "$@"
    fi
    out="$(realpath -m "${2:-docs/benchmarks}")"
    mkdir -p "$out"
    python3 tools/make_models.py --set test --only accel-tiny- | tail -3  # the families (bench/gpu.py writes its Flux)
    status=0
    python3 bench/gpu.py --budget "$BUDGET" --out "$out/gpu.md" 2>&1 | tee "$out/gpu_log.txt" || status=$?
    cp bench/results/compile_flux.json "$out/" 2>/dev/null || true
    exit "$status"
    ;;
*)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
