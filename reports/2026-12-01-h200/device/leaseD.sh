#!/usr/bin/env bash
# lease 2, call D: the seed's shape (Qwen2.5-14B-1M, Q8_0): prefill/decode before/after staging as the tail grows
# (ubatch 4096), then auto mode: llama-server -m 14b -c 1048576 with no other flag, and a context past host RAM
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $REP $OUT
exec > >(tee $OUT/D.log) 2>&1
date -u
timeout 300 python3 -m rollkv_dist gates --build $W/prefix --gates curve --gpu 0 --work $W/gates --reports $REP/D-curve14b --llama-tree $W/src --curve-shape qwen2.5-14b-1m --curve-ubatch 4096 --curve-no-nkvo --curve-fractions 0.75,0.5,0.25 --reps 1 2>&1 | tail -6
M14=$(ls $W/gates/models/qwen2.5-14b-1m-q8_0*.gguf | head -1)
S=$W/prefix/bin/llama-server
python3 .carry/server_checks.py $S $REP/auto-1m.json auto-14b-1M 200 -m $M14 -c 1048576
free -g | head -2
python3 .carry/server_checks.py $S $REP/auto-4m.json auto-14b-4M-past-host-RAM 60 -m $M14 -c 4194304
timeout 150 python3 -m rollkv_dist gates --build $W/prefix --gates curve --gpu 0 --work $W/gates --reports $REP/D-curve15b --llama-tree $W/src --reps 1 2>&1 | tail -3
tar czf $OUT/D.tar.gz -C $W rep/D-curve15b 2>/dev/null; mv $OUT/D.tar.gz $OUT/D15.tar.gz 2>/dev/null
tar czf $OUT/D.tar.gz -C $W rep/D-curve14b rep/auto-1m.json rep/auto-1m.log rep/auto-4m.json rep/auto-4m.log
date -u
