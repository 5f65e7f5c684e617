#!/usr/bin/env bash
# conda-build script for rollkv-llamafile: rollkv's one build definition
# (rollkv_dist/cmake/: the initial cache rollkv.cmake, the target rollkv-programs,
# the install rule rollkv-install.cmake; the same three steps as `rollkv build` and
# flake.nix) with conda's toolchain ($CMAKE_ARGS).
#
# Inputs (conda-build sets them; tests/test_recipe_build.py sets the same ones):
#   SRC_DIR                 unpacked llama-cpp-python sdist (llama.cpp in vendor/llama.cpp),
#                           or a llama.cpp tree (e.g. an unpacked `rollkv pack` archive)
#   SRC_DIR/rollkv-patches  the patch queue (second source of meta.yaml)
#   SRC_DIR/rollkv-tool     rollkv_dist (third source): the series tool and the CMake files
#   PREFIX, CPU_COUNT, PKG_VERSION, PKG_BUILDNUM, CMAKE_ARGS (conda-forge toolchain)
#   cuda_compiler_version   conda-build variant; "None" (or unset) = CPU-only build
# Knobs (optional):
#   ROLLKV_BUILD_TARGETS    programs to build instead of rollkv.cmake's ROLLKV_PROGRAMS
#   ROLLKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES instead of rollkv.cmake's list
#   ROLLKV_PATCH_DIR, ROLLKV_TOOL_DIR  other places for the queue and for rollkv_dist's parent
#   ROLLKV_BUILD_DIR        CMake binary dir (default: $SRC_DIR/build-rollkv)
#   ROLLKV_PYTHON           python for the series tool (default: python3)
set -euo pipefail

: "${SRC_DIR:?SRC_DIR must be set}"
: "${PREFIX:?PREFIX must be set}"
jobs="${CPU_COUNT:-2}"
cuda="${cuda_compiler_version:-None}"
tool="${ROLLKV_TOOL_DIR:-${SRC_DIR}/rollkv-tool}"
queue="${ROLLKV_PATCH_DIR:-${SRC_DIR}/rollkv-patches}"
cmake_dir="${tool}/rollkv_dist/cmake"
build_dir="${ROLLKV_BUILD_DIR:-${SRC_DIR}/build-rollkv}"

series() { PYTHONPATH="${tool}" "${ROLLKV_PYTHON:-python3}" -m rollkv_dist.series "$@"; }

# --- locate the llama.cpp tree -------------------------------------------------
if [[ -f "${SRC_DIR}/CMakeLists.txt" ]] && grep -q 'project("llama.cpp"' "${SRC_DIR}/CMakeLists.txt"; then
    tree="${SRC_DIR}"
elif [[ -f "${SRC_DIR}/vendor/llama.cpp/CMakeLists.txt" ]]; then
    tree="${SRC_DIR}/vendor/llama.cpp"
else
    echo "build.sh: no llama.cpp tree in ${SRC_DIR} (expected vendor/llama.cpp)" >&2
    exit 2
fi

# --- the patch series -----------------------------------------------------------
# conda-build's own `patches:` key guesses the strip level against the source root;
# the series is relative to vendor/llama.cpp, so the series tool applies it (git apply,
# no fuzz, in series order) and checks every touched file against manifest.json
series apply "${tree}" "${queue}"
commit="$(series build-commit "${tree}" "${queue}")"

# --- configure, build, install ------------------------------------------------------
# the tarball has no .git: keep cmake's git probe from finding an enclosing repository
export GIT_CEILING_DIRECTORIES="$(dirname "${tree}")"
cmake_args=(
    -C "${cmake_dir}/rollkv.cmake"
    -G Ninja
    -S "${tree}"
    -B "${build_dir}"
    -DCMAKE_INSTALL_PREFIX="${PREFIX}"
    -DCMAKE_PREFIX_PATH="${PREFIX}"
    -DLLAMA_BUILD_COMMIT="${commit}"
)
if [[ -n "${ROLLKV_BUILD_TARGETS:-}" ]]; then
    cmake_args+=(-DROLLKV_PROGRAMS="$(echo ${ROLLKV_BUILD_TARGETS} | tr ' ' ';')")
fi
if [[ "${cuda}" != "None" ]]; then
    cmake_args+=(-DGGML_CUDA=ON)
    if [[ -n "${ROLLKV_CUDA_ARCHITECTURES:-}" ]]; then
        cmake_args+=(-DCMAKE_CUDA_ARCHITECTURES="${ROLLKV_CUDA_ARCHITECTURES}")
    fi
fi
# CMAKE_ARGS (conda-forge toolchain settings) is a space-separated string
# shellcheck disable=SC2086
cmake ${CMAKE_ARGS:-} "${cmake_args[@]}"
cmake --build "${build_dir}" --target rollkv-programs -j "${jobs}"
cmake -DROLLKV_BUILD_DIR="${build_dir}" -DCMAKE_INSTALL_PREFIX="${PREFIX}" -P "${cmake_dir}/rollkv-install.cmake"

# --- record what was built: the series, its patches, build-info.txt ------------------
series record --tree "${tree}" "${queue}" "${PREFIX}" \
    "version=${PKG_VERSION:-unknown}" "build_number=${PKG_BUILDNUM:-0}" \
    "build_commit=${commit}" "cuda=${cuda}" \
    "targets=$(tr ';' ' ' < "${build_dir}/rollkv-programs.txt")"
