#!/usr/bin/env bash
# lease 2, call C: the speed gate at depth 65536 (before/after incl. off, f16 and q8_0)
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $REP $OUT
exec > >(tee $OUT/C.log) 2>&1
date -u
timeout 540 python3 -m rollkv_dist gates --build $W/prefix --gates speed --gpu 0 --work $W/gates --reports $REP/C-speed64k --llama-tree $W/src --speed-depths 65536 --reps 2 --speed-off-max-depth 65536 --ubatch-sweep none 2>&1 | tail -8
tar czf $OUT/C.tar.gz -C $W rep/C-speed64k
date -u
