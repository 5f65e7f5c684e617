#!/usr/bin/env bash
# Device script (not run by CI): one GPU lease for issue 26's remaining cases, in calls that each fit 10 minutes.
# Run from the repo copy on the device, with the packed tree carried as .carry/rollkv-src.tar.xz
# (`rollkv pack .carry/rollkv-src.tar.xz --with-tests`). Everything lives under /tmp/rk, so it survives between
# calls on the same warm machine; what comes back is written under $OUT.
#
#   bash tests/gpu/budget_lease.sh after    # unpack, build, K-shift (window under a ballast, resident free), draft
#   bash tests/gpu/budget_lease.sh gates    # the server gate (every case) and the archs gate
#   bash tests/gpu/budget_lease.sh before   # the chunked K-shift patch (0098) reverted, incremental rebuild, the K-shift again
set -uo pipefail
S=/tmp/rk
OUT=${OUT:-$S/out}
mkdir -p "$S" "$OUT"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
TARGETS=llama-logits-dump,test-llama-archs,llama-server,llama-perplexity
build() {  # build PREFIX: the tree at $S/src into PREFIX (incremental in $S/bld)
    python3 -m rollkv_dist build --source "$S/src" --prefix "$1" --build-dir "$S/bld" --variant cuda \
        --cuda-arch 90-real -j 16 --targets "$TARGETS" --cmake-arg=-DLLAMA_BUILD_TESTS=ON 2>&1 | tail -4
}
budget() {  # budget STEP [args]: tests/gpu/budget_scratch.py against the given prefix
    python3 tests/gpu/budget_scratch.py "$@" --work "$S/w"
}
collect() {  # the small results only (never the gates' work folders whole)
    (cd "$S" && tar -czf "$OUT/$1.tar.gz" --ignore-failed-read w/*.json rep 2>/dev/null)
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt"
}
case "${1:-}" in
after)
    if [ ! -d "$S/src" ]; then
        tar -xJf .carry/rollkv-src.tar.xz -C "$S" && mv "$S/rollkv-src" "$S/src"
    fi
    t=$(date +%s); build "$S/after"; echo "build_seconds $(( $(date +%s) - t ))"
    budget inputs --build "$S/after" --llama-tree "$S/src"
    budget kshift --build "$S/after" --label after
    budget kshift --build "$S/after" --label after --free
    budget draft --build "$S/after"
    collect after
    ;;
gates)
    python3 -m rollkv_dist gates --build "$S/after" --gates server --gpu 0 --llama-tree "$S/src" \
        --work "$S/gw" --reports "$S/rep" 2>&1 | tail -25
    python3 -m rollkv_dist gates --build "$S/after" --gates archs --gpu 0 --llama-tree "$S/src" \
        --work "$S/gw" --reports "$S/rep" 2>&1 | tail -25
    collect gates
    ;;
before)
    (cd "$S/src" && { git apply -R patches/0098-*.patch || patch -R -p1 < patches/0098-*.patch; }) || exit 1
    t=$(date +%s); build "$S/before"; echo "build_seconds $(( $(date +%s) - t ))"
    budget kshift --build "$S/before" --label before
    (cd "$S/src" && git apply patches/0098-*.patch)
    collect before
    ;;
*)
    echo "usage: $0 after|gates|before" >&2
    exit 2
    ;;
esac
