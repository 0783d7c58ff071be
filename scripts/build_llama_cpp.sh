#!/usr/bin/env bash
# Build llama.cpp (CPU only, offline) as a same-run peer for hyla's CPU benchmark
# (benchmarks/llama_cpp.py).
#
#     scripts/build_llama_cpp.sh [DEST] [SDIST]
#
# DEST   where the llama.cpp source tree goes (default: ../llama.cpp next to the repo root);
#        the build lands in DEST/build/bin (llama-bench, llama-server, llama-simple).
# SDIST  a llama-cpp-python sdist (.tar.gz); without it, pip downloads llama-cpp-python==0.3.36
#        (sha256-checked). Its vendor/llama.cpp is the llama.cpp tree (0.3.36 vendors
#        ggml-org/llama.cpp@0c1e57098); the Python bindings are not built.
#
# If DEST already holds a tree (DEST/CMakeLists.txt) it is reused, so a rerun only re-runs cmake,
# which is incremental. About 6 minutes on 2 cores from scratch (JOBS=2). The tree is no git
# checkout, so cmake's build-info step prints "fatal: not a git repository" (harmless; the
# binaries report build 0, commit unknown).
#
# Offline: no curl/OpenSSL (no model downloads, no HTTPS), no web UI for llama-server (its
# prebuilt UI would be fetched from Hugging Face at build time), no tests/examples besides
# llama-simple. GGML_NATIVE (the default) tunes for this CPU, as torch's CPU kernels do.
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/../llama.cpp}"
SDIST="${2:-}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

if [ ! -f "$DEST/CMakeLists.txt" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    if [ -z "$SDIST" ]; then
        "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
        SDIST="$(ls "$tmp"/llama_cpp_python-*.tar.gz)"
        echo "$SHA256  $SDIST" | sha256sum -c -
    fi
    tar -xzf "$SDIST" -C "$tmp"
    mkdir -p "$(dirname "$DEST")"
    if [ -e "$DEST" ]; then rmdir "$DEST"; fi  # an empty directory is fine, anything else stops here
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DEST"
fi
DEST="$(cd "$DEST" && pwd)"

cmake -S "$DEST" -B "$DEST/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON
cmake --build "$DEST/build" --config Release -j "$JOBS" --target llama-bench llama-server llama-simple

ls -l "$DEST/build/bin/llama-bench" "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-simple"
