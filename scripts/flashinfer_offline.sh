#!/usr/bin/env bash
# FlashInfer's norm kernels on a GPU machine without network, in two steps.
#
#   scripts/flashinfer_offline.sh fetch     # on a machine with network, from the repo root
#   source scripts/flashinfer_offline.sh install   # on the GPU machine, from the repo root
#
# fetch downloads flashinfer-python and the packages its norm path imports that a CUDA
# image with PyTorch usually lacks (apache-tvm-ffi, cuda-tile), for CPython $PYVER on
# x86_64 Linux, unpacks them, keeps of FlashInfer's 330 MB of CUDA sources only the ones
# its norm module compiles (csrc/norm.cu, csrc/flashinfer_norm_binding.cu,
# csrc/tvm_ffi_utils.h, and the header trees they include), and packs the result into
# .flashinfer/site.tar.xz (about 15 MB: it travels where a 62 MB wheel would not).
# nvidia-cutlass-dsl (FlashInfer's default CuTe-DSL norm path) is left out: its CUDA 13
# library wheel alone is 92 MB; without it FlashInfer selects its CUDA JIT norm path
# (flashinfer/norm/__init__.py falls back when the import fails) and install sets
# FLASHINFER_USE_CUDA_NORM=1 to say so. install unpacks the tarball into /tmp and puts
# it on PYTHONPATH; the first call of each norm compiles csrc/norm.cu with the machine's
# nvcc and ninja (about a minute), cached under ~/.cache/flashinfer.
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.2.post1}
PYVER=${PYVER:-3.12}
dest=.flashinfer

fetch() (  # a subshell: its settings stay inside
  set -euo pipefail
  local tmp
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp/wheels" \
    "flashinfer-python==$FLASHINFER_VERSION" "apache-tvm-ffi>=0.1.11,<0.2" "cuda-tile>=1.4"
  mkdir -p "$tmp/site"
  for w in "$tmp"/wheels/*.whl; do
    python3 -m zipfile -e "$w" "$tmp/site"
  done
  local data="$tmp/site/flashinfer/data"
  mkdir "$tmp/keep"
  cp "$data/csrc/norm.cu" "$data/csrc/flashinfer_norm_binding.cu" \
    "$data/csrc/tvm_ffi_utils.h" "$tmp/keep/"
  rm -rf "$data/csrc" && mv "$tmp/keep" "$data/csrc"
  # kernels of other subsystems that ship as data files; their Python modules stay
  find "$tmp/site/flashinfer/experimental" "$tmp/site/flashinfer/moe_ep" \
    "$tmp/site/flashinfer/fused_moe" -type f ! -name '*.py' -delete
  find "$tmp/site" -name RECORD -path '*.dist-info/*' -delete
  mkdir -p "$dest"
  tar cf - -C "$tmp" site | xz -T0 -6 > "$dest/site.tar.xz"
  rm -rf "$tmp"
  grep -qxF "/$dest/" .git/info/exclude 2>/dev/null || echo "/$dest/" >> .git/info/exclude
  du -h "$dest/site.tar.xz"
)

install() {
  local site=/tmp/flashinfer-site
  rm -rf "$site" && mkdir -p "$site"
  tar xJf "$dest/site.tar.xz" -C "$site" --strip-components=1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export FLASHINFER_USE_CUDA_NORM=1
  python3 -c 'import flashinfer, flashinfer.norm; print("flashinfer", flashinfer.__version__)'
}

case ${1:-} in
  fetch) fetch ;;
  install) install ;;
  *) echo "usage: $0 fetch | source $0 install" >&2; return 2 2>/dev/null || exit 2 ;;
esac
