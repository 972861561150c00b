#!/usr/bin/env bash
# `make bench-gpu` on a bare GPU machine that has Python, torch and most of ComfyUI's requirements, but no ComfyUI,
# no models and no package index (a lent machine that receives only a copy of this checkout, 64 MiB at most).
#
#   tools/gpu_bundle.sh pack          # here, after `make setup`: writes .gpu/ (git-ignored)
#   tools/gpu_bundle.sh run [OUT]     # there, in the copied checkout: unpacks, writes the models, runs bench/gpu.py
#   tools/gpu_bundle.sh with CMD...   # there: unpacks, then runs CMD with that ComfyUI (e.g. one bench script)
#
# .gpu/comfyui.tar.xz is the ComfyUI under test without its models or caches; .gpu/site.tar.xz holds, unpacked, the
# wheels of ComfyUI's imports that such a machine lacked on 2026-11-26 (Python 3.12, torch 2.11.0+cu130): PyAV and
# torchsde with its trampoline. xz, because PyAV's wheel alone is 36 MB. The ComfyUI 0.33 step (bench/gpu.py) gets
# .gpu/comfyui-0.33.tar.xz (the shared 0.33.0 tree, ../shared/comfyui/0.33.0) and .gpu/site-0.33.tar.xz: the
# wheels 0.33 needs beyond those, comfy-aimdo and comfy-kitchen at its requirements' pins, blake3 and simpleeval.
# comfy-kitchen's wheel is 58 MB, most of it device code for six GPU generations: its ROCm backend is left out
# and its CUDA library cut to sm_90 machine code (tools/harness/fatbin.py; GPU_ARCHS to change), which
# `run` checks on the GPU before anything else (a failed check removes it: kitchen then runs its eager backend,
# and the log says so). GPU_BUNDLE_033=0 leaves 0.33 out. The checkout itself travels too (28 MB on 2026-12-01,
# the digits models in bench/assets most of it): `pack` prints what the call would carry against the 64 MiB.
# `run` writes gpu.md, its log and the Flux step's JSON into OUT (default docs/benchmarks/) in at most 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="av==18.1.0 torchsde==0.2.6 trampoline==0.1.2"
WHEELS_033="blake3==1.0.11 simpleeval==1.0.8"  # comfy-aimdo and comfy-kitchen: 0.33's own pins, read below
SOURCE_033="../shared/comfyui/0.33.0"
BUDGET="${GPU_BUDGET:-540}"  # bench/gpu.py's seconds for all its steps: a 10-minute call, less the unpacking and models
PY="${ACCEL_VENV:-.venv}/bin/python"

download() {  # download DIR WHEEL...: Python 3.12 x86-64 wheels, no dependencies (each one named)
    local dir="$1"
    shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
        --platform manylinux2010_x86_64 -d "$dir" "$@"
}

tree() {  # tree ARCHIVE FOLDER: a ComfyUI without its models, caches, tests or the pack
    tar -cJf "$1" -C "$(dirname "$(realpath "$2")")" --exclude='*.safetensors' --exclude='*.pt' \
        --exclude='*.pth' --exclude='*.ckpt' --exclude=accel_cache --exclude=accel-template-standins \
        --exclude=__pycache__ --exclude=.git --exclude=comfyui-accel --exclude=tests --exclude=tests-unit \
        --exclude=blueprints --exclude='comfy/text_encoders/*_tokenizer' --exclude=comfy/sd1_tokenizer \
        --exclude='output/*' --exclude='temp/*' "$(basename "$(realpath "$2")")"  # the text encoders' vocabularies
    # (17 MB, read only by a text encoder, which no step loads; comfy/ldm/cosmos/cosmos_tokenizer is code: kept)
}

case "${1:-}" in
pack)
    comfy="${COMFYUI_DIR:-.comfyui/ComfyUI}"
    rm -rf .gpu && mkdir -p .gpu/wheels .gpu/site
    download .gpu/wheels $WHEELS
    for wheel in .gpu/wheels/*.whl; do (cd .gpu/site && unzip -q -o "../../$wheel"); done
    tar -cJf .gpu/site.tar.xz -C .gpu/site .
    tree .gpu/comfyui.tar.xz "$comfy"
    if [ "${GPU_BUNDLE_033:-1}" != 0 ] && [ -f "$SOURCE_033/main.py" ]; then
        pins="$(grep -E '^comfy-(aimdo|kitchen)==' "$SOURCE_033/requirements.txt" | tr '\n' ' ')"
        mkdir -p .gpu/wheels-033 .gpu/site-033
        download .gpu/wheels-033 $pins $WHEELS_033
        for wheel in .gpu/wheels-033/*.whl; do (cd .gpu/site-033 && unzip -q -o "../../$wheel"); done
        rm -rf .gpu/site-033/comfy_kitchen/backends/hip  # AMD's: imported only by a ROCm torch
        "$PY" -m tools.harness.fatbin .gpu/site-033/comfy_kitchen/backends/cuda/_C.abi3.so --keep "${GPU_ARCHS:-90}" \
            --no-ptx
        tar -cf - -C .gpu/site-033 . | xz -6 -T0 > .gpu/site-0.33.tar.xz
        tree .gpu/comfyui-0.33.tar.xz "$SOURCE_033"
    fi
    rm -rf .gpu/wheels .gpu/site .gpu/wheels-033 .gpu/site-033
    du -sh .gpu/*.tar.xz
    tracked="$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)"
    bundle="$(du -cb .gpu/*.tar.xz | tail -1 | cut -f1)"
    echo "the call would carry $(( (tracked + bundle) / 1048576 )) MiB of 64: the checkout's files $(( tracked / 1048576 )), .gpu/ $(( bundle / 1048576 ))"
    echo "then on the GPU machine, in a copy of this checkout that carries .gpu/: tools/gpu_bundle.sh run [OUT]"
    ;;
run | with)
    mkdir -p /tmp/accel-gpu-site .gpu/comfy
    tar -xJf .gpu/site.tar.xz -C /tmp/accel-gpu-site
    tar -xJf .gpu/comfyui.tar.xz -C .gpu/comfy
    export PYTHONPATH="/tmp/accel-gpu-site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    COMFYUI_DIR="$(realpath .gpu/comfy/*/)"
    export COMFYUI_DIR
    if [ -f .gpu/site-0.33.tar.xz ]; then  # the ComfyUI 0.33 step's (bench/gpu.py reads these two)
        mkdir -p /tmp/accel-gpu-site-033 .gpu/comfy-033
        tar -xJf .gpu/site-0.33.tar.xz -C /tmp/accel-gpu-site-033
        tar -xJf .gpu/comfyui-0.33.tar.xz -C .gpu/comfy-033
        export ACCEL_GPU_SITE_033=/tmp/accel-gpu-site-033 ACCEL_GPU_COMFYUI_033="$(realpath .gpu/comfy-033/*/)"
        # the cut kitchen library, checked where it runs: its rope against the formula it replaces
        PYTHONPATH="$ACCEL_GPU_SITE_033:$PYTHONPATH" python3 -c "
import torch, comfy_kitchen as ck
from comfy_kitchen.backends import cuda
assert cuda._C is not None, 'comfy-kitchen CUDA library did not load'
x, f = torch.randn(1, 2, 8, 64, device='cuda'), torch.randn(1, 1, 8, 32, 2, 2, device='cuda')
ref = (f[..., 0] * x.reshape(*x.shape[:-1], -1, 1, 2)[..., 0] + f[..., 1] * x.reshape(*x.shape[:-1], -1, 1, 2)[..., 1]).reshape(x.shape)
out = ck.apply_rope1(x, f)
assert torch.allclose(out, ref, atol=1e-4), float((out - ref).abs().max())
print('[bundle] comfy-kitchen CUDA backend (cut to sm_${GPU_ARCHS:-90}) loads and ropes like the formula')
" || { echo "[bundle] comfy-kitchen's cut CUDA library failed its check: removed, kitchen runs its eager backend"
               rm -f "$ACCEL_GPU_SITE_033/comfy_kitchen/backends/cuda/_C.abi3.so"; }
    fi
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
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
