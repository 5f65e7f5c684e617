#!/usr/bin/env bash
# conda-build script for rollkv-llamafile.
#
# Inputs (conda-build sets them; tests/test_recipe_build.py sets the same ones):
#   SRC_DIR                 unpacked llama-cpp-python sdist (llama.cpp in vendor/llama.cpp),
#                           with the patch queue copied to $SRC_DIR/rollkv-patches
#                           (second source in meta.yaml). A SRC_DIR that already is a
#                           llama.cpp tree (CMakeLists.txt with project("llama.cpp")) is
#                           built as it is.
#   PREFIX                  install prefix
#   CPU_COUNT               parallel jobs
#   PKG_VERSION, PKG_BUILDNUM
#   cuda_compiler_version   conda-build variant; "None" (or unset) = CPU-only build
#   CMAKE_ARGS              conda-forge toolchain arguments (optional)
# Knobs (optional):
#   ROLLKV_BUILD_TARGETS    programs to build (default: llama-server llama-cli llama-bench,
#                           plus llama-logits-dump when the series adds tools/logits-dump);
#                           "all" builds and installs everything upstream installs
#   ROLLKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES for CUDA builds
#   ROLLKV_LLAMA_COMMIT, ROLLKV_LLAMA_BUILD_NUMBER  recorded as LLAMA_BUILD_COMMIT/NUMBER
#   ROLLKV_BUILD_DIR        CMake binary dir (default: $SRC_DIR/build-rollkv)
set -euo pipefail

: "${SRC_DIR:?SRC_DIR must be set}"
: "${PREFIX:?PREFIX must be set}"
jobs="${CPU_COUNT:-2}"
cuda="${cuda_compiler_version:-None}"

# --- locate the llama.cpp tree -------------------------------------------------
if [[ -f "${SRC_DIR}/CMakeLists.txt" ]] && grep -q 'project("llama.cpp"' "${SRC_DIR}/CMakeLists.txt"; then
    tree="${SRC_DIR}"
elif [[ -f "${SRC_DIR}/vendor/llama.cpp/CMakeLists.txt" ]]; then
    tree="${SRC_DIR}/vendor/llama.cpp"
else
    echo "build.sh: no llama.cpp tree in ${SRC_DIR} (expected vendor/llama.cpp)" >&2
    exit 2
fi

# --- apply the patch series ---------------------------------------------------
# conda-build's own `patches:` key guesses the strip level against the source
# root; the series is relative to vendor/llama.cpp, so it is applied here, in
# the order of patches/series, with no fuzz allowed.
patch_dir="${SRC_DIR}/rollkv-patches"
applied_series=""
if [[ -f "${patch_dir}/series" ]]; then
    stamp="${tree}/.rollkv-series-applied"
    if [[ -f "${stamp}" ]]; then
        if ! cmp -s "${stamp}" "${patch_dir}/series"; then
            echo "build.sh: ${tree} was patched with a different series" >&2
            exit 3
        fi
    else
        while IFS= read -r line || [[ -n "${line}" ]]; do
            name="$(echo "${line%%#*}" | tr -d '[:space:]')"
            [[ -z "${name}" ]] && continue
            echo "build.sh: applying ${name}"
            patch -p1 --forward --fuzz=0 --no-backup-if-mismatch -d "${tree}" \
                -i "${patch_dir}/${name}"
        done < "${patch_dir}/series"
        cp "${patch_dir}/series" "${stamp}"
    fi
    applied_series="${patch_dir}/series"
    # byte-identical check: patches/manifest.json (written by `rollkv patches
    # export`) records the sha256 of every patch and of every file the series
    # touches; a patch that applied at an offset to another tree is caught here
    "${ROLLKV_PYTHON:-python3}" "${RECIPE_DIR:-$(dirname "${BASH_SOURCE[0]}")}/verify_manifest.py" \
        "${tree}" "${patch_dir}"
fi

# --- configure ------------------------------------------------------------------
# default programs; the logits dump tool comes with the series (the gates use it)
targets="${ROLLKV_BUILD_TARGETS:-llama-server llama-cli llama-bench}"
if [[ -z "${ROLLKV_BUILD_TARGETS:-}" && -d "${tree}/tools/logits-dump" ]]; then
    targets="${targets} llama-logits-dump"
fi
n_patches=0
if [[ -n "${applied_series}" ]]; then
    n_patches="$(sed -e 's/#.*//' "${applied_series}" | grep -c '[^[:space:]]' || true)"
fi
# the tarball has no .git: keep cmake's git probe from finding an enclosing repository
export GIT_CEILING_DIRECTORIES="$(dirname "${tree}")"
build_dir="${ROLLKV_BUILD_DIR:-${SRC_DIR}/build-rollkv}"
cmake_args=(
    -G Ninja
    -S "${tree}"
    -B "${build_dir}"
    -DCMAKE_BUILD_TYPE=Release
    -DCMAKE_INSTALL_PREFIX="${PREFIX}"
    -DCMAKE_INSTALL_LIBDIR=lib
    -DCMAKE_PREFIX_PATH="${PREFIX}"
    # relocatable: programs and libraries find each other through $ORIGIN,
    # both in the install tree and when copied out of the build tree
    -DCMAKE_INSTALL_RPATH='$ORIGIN/../lib;$ORIGIN'
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON
    -DBUILD_SHARED_LIBS=ON
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_TOOLS_INSTALL=ON
    # offline-safe: no web UI download or npm, no HTTPS client, no NCCL
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_NUMBER="${ROLLKV_LLAMA_BUILD_NUMBER:-0}"
    -DLLAMA_BUILD_COMMIT="${ROLLKV_LLAMA_COMMIT:-unknown}+rollkv.${n_patches}"
    # a package runs on machines other than the build host
    -DGGML_NATIVE=OFF
    -DGGML_CCACHE=OFF
)
if [[ "${cuda}" != "None" ]]; then
    cmake_args+=(
        -DGGML_CUDA=ON
        -DGGML_CUDA_NCCL=OFF
        -DCMAKE_CUDA_ARCHITECTURES="${ROLLKV_CUDA_ARCHITECTURES:-75-real;80-real;86-real;89-real;90-real;100-real;120-real;120-virtual}"
    )
else
    cmake_args+=(-DGGML_CUDA=OFF)
fi

# CMAKE_ARGS (conda-forge toolchain settings) is a space-separated string
# shellcheck disable=SC2086
cmake ${CMAKE_ARGS:-} "${cmake_args[@]}"

# --- build and install --------------------------------------------------------
if [[ "${targets}" == "all" ]]; then
    cmake --build "${build_dir}" -j "${jobs}"
    cmake --install "${build_dir}"
else
    # shellcheck disable=SC2086
    cmake --build "${build_dir}" -j "${jobs}" --target ${targets}
    # Libraries, headers, CMake and pkg-config files: upstream's own install
    # rules for the top directory (not recursing into tools/) and for ggml.
    cmake -DCMAKE_INSTALL_LOCAL_ONLY=ON -P "${build_dir}/cmake_install.cmake"
    cmake -P "${build_dir}/ggml/cmake_install.cmake"
    mkdir -p "${PREFIX}/bin" "${PREFIX}/lib"
    for t in ${targets}; do
        install -m 0755 "${build_dir}/bin/${t}" "${PREFIX}/bin/${t}"
    done
    # The tools' helper libraries (server, mtmd, ...) are shared libraries in
    # the build tree's bin/; install those the programs need (DT_NEEDED,
    # followed through the libraries), each with its symlink chain.
    readelf_bin="${READELF:-readelf}"
    pending=()
    for t in ${targets}; do pending+=("${build_dir}/bin/${t}"); done
    seen=" "
    while [[ ${#pending[@]} -gt 0 ]]; do
        obj="${pending[0]}"
        pending=("${pending[@]:1}")
        for lib in $("${readelf_bin}" -d "${obj}" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
            [[ "${seen}" == *" ${lib} "* ]] && continue
            seen="${seen}${lib} "
            [[ -e "${build_dir}/bin/${lib}" ]] || continue   # a system library
            link="${build_dir}/bin/${lib}"
            while [[ -L "${link}" ]]; do
                [[ -e "${PREFIX}/lib/$(basename "${link}")" ]] || cp -P "${link}" "${PREFIX}/lib/"
                link="$(dirname "${link}")/$(readlink "${link}")"
            done
            [[ -e "${PREFIX}/lib/$(basename "${link}")" ]] || cp "${link}" "${PREFIX}/lib/"
            pending+=("${link}")
        done
    done
fi

# --- record what was built ------------------------------------------------------
share="${PREFIX}/share/rollkv-llamafile"
mkdir -p "${share}"
# the series and the patches it names: which changes this binary carries
mkdir -p "${share}/patches"
if [[ -n "${applied_series}" ]]; then
    cp "${applied_series}" "${share}/series"
    while IFS= read -r line || [[ -n "${line}" ]]; do
        name="$(echo "${line%%#*}" | tr -d '[:space:]')"
        [[ -z "${name}" ]] && continue
        cp "${patch_dir}/${name}" "${share}/patches/${name}"
    done < "${applied_series}"
else
    : > "${share}/series"
fi
{
    echo "version=${PKG_VERSION:-unknown}"
    echo "build_number=${PKG_BUILDNUM:-0}"
    echo "llama_commit=${ROLLKV_LLAMA_COMMIT:-unknown}"
    echo "cuda=${cuda}"
    echo "targets=${targets}"
} > "${share}/build-info.txt"
