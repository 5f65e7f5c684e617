#!/usr/bin/env bash
# Test of an installed rollkv-llamafile: conda-build runs it in the test
# environment; tests/test_recipe_build.py runs it in a prefix installed with
# py-rattler, the flake's checks against the Nix build, the tool integration test
# against a `rollkv build` prefix. Each program must start and print its usage, and the rolling-KV
# flags (docs/ENGINE-INTERFACE.md) must be there exactly when the patch series
# recorded in the package adds them: a flag that an applied patch adds must be
# in --help, and one that no patch adds must not be (upstream has none of them).
set -euo pipefail

: "${PREFIX:?PREFIX must be set}"
share="${PREFIX}/share/rollkv-llamafile"
test -f "${share}/patches/series"
test -f "${share}/build-info.txt"

# CUDA builds link libcuda.so.1, which only an NVIDIA driver provides. On a
# machine without one, start the programs against the driver stub from
# cuda-driver-dev (CUDA then reports no device; --help does not need one).
cuda_build="$(sed -n 's/^cuda=//p' "${share}/build-info.txt")"
if [[ "${cuda_build}" != "None" ]] \
    && ldd "${PREFIX}/bin/llama-server" 2>/dev/null | grep -q 'libcuda\.so\.1 => not found'; then
    stub="$(find "${PREFIX}/lib/stubs" "${PREFIX}"/targets/*/lib/stubs -name 'libcuda.so' 2>/dev/null | head -n1 || true)"
    if [[ -z "${stub}" ]]; then
        echo "run_test.sh: CUDA build, no driver and no libcuda.so stub" >&2
        exit 1
    fi
    stubdir="$(mktemp -d)"
    ln -s "${stub}" "${stubdir}/libcuda.so.1"
    export LD_LIBRARY_PATH="${stubdir}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
fi

# Does an applied patch add this flag? (a "+" line of a recorded patch naming it in
# quotes; share/.../patches holds exactly the patches of the applied series)
added_by_series() {
    local flag="$1" patch
    for patch in "${share}"/patches/*.patch; do
        [[ -e "${patch}" ]] || continue
        if grep -q -- "^+.*\"${flag}\"" "${patch}"; then
            return 0
        fi
    done
    return 1
}

fail=0
check() {
    local prog="$1"; shift
    local out
    if ! out="$("${PREFIX}/bin/${prog}" --help 2>&1)"; then
        echo "FAIL: ${prog} --help exited non-zero" >&2
        echo "${out}" | tail -n 20 >&2
        fail=1
        return
    fi
    if ! grep -q -- '--help' <<<"${out}"; then
        echo "FAIL: ${prog} --help printed no usage" >&2
        fail=1
        return
    fi
    local flag
    for flag in "$@"; do
        if added_by_series "${flag}"; then
            if grep -q -- "${flag}" <<<"${out}"; then
                echo "ok: ${prog} --help shows ${flag}"
            else
                echo "FAIL: ${prog} --help lacks ${flag}, which the series adds" >&2
                fail=1
            fi
        else
            if grep -q -- "${flag}" <<<"${out}"; then
                echo "FAIL: ${prog} --help shows ${flag}, which no patch in the series adds" >&2
                fail=1
            else
                echo "ok: ${prog} --help has no ${flag} (not in the series)"
            fi
        fi
    done
}

check llama-server --kv-residency-mode --vram-target --kv-compute-reserve
check llama-cli --kv-residency-mode --vram-target --kv-compute-reserve
check llama-bench --kv-residency-mode --vram-target
# ggml-rpc-server where the build made it (rollkv.cmake's GGML_RPC; a tree without tools/rpc has none)
if grep -qE '^targets=(.* )?ggml-rpc-server( |$)' "${PREFIX}/share/rollkv-llamafile/build-info.txt" 2>/dev/null; then
    check ggml-rpc-server
fi

if [[ "${fail}" != 0 ]]; then
    exit 1
fi
echo "run_test.sh: all checks passed"
