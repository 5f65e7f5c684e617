#!/usr/bin/env bash
# early validation lease: build the series, tail-staging probe at 16k (GPU0) and parity with staging (GPU1)
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID ROLLKV_REPO=$PWD PYTHONPATH=$PWD
W=/tmp/w; mkdir -p $W $OUT
exec > >(tee $OUT/lease1.log) 2>&1
date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used --format=csv
tar xJf .carry/src.tar.xz -C $W
t0=$(date +%s)
python3 -m rollkv_dist build --source $W/src --prefix $W/prefix --variant cuda --cuda-arch 90-real -j 16 > $W/build.log 2>&1 || { tail -40 $W/build.log; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"; tail -3 $W/build.log
python3 -m rollkv_dist model random -o $W/q15.gguf --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src 2>&1 | tail -2
ls -la $W/prefix/bin
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 .carry/stage_probe.py $W/prefix/bin/llama-bench $W/q15.gguf 16384 $W/probe16k f16,q8_0 ub
timeout 150 python3 -m rollkv_dist gates --build $W/prefix --gates resident-parity --gpu 0 --work $W/gates --reports $W/rep/parity-auto --llama-tree $W/src > $W/parity-auto.log 2>&1
mkdir -p $W/gates-on && ln -sfn $W/gates/models $W/gates-on/models
LLAMA_ARG_KV_TAIL_STAGING=on timeout 120 python3 -m rollkv_dist gates --build $W/prefix --gates resident-parity --gpu 0 --work $W/gates-on --reports $W/rep/parity-on --llama-tree $W/src > $W/parity-on.log 2>&1
tail -5 $W/parity-auto.log $W/parity-on.log
cp $W/build.log $W/rep/ 2>/dev/null
tar czf $OUT/lease1.tar.gz -C $W --exclude='*.gguf' --exclude='*.bin' --exclude='*.f32' probe16k rep parity-auto.log parity-on.log gates gates-on 2>/dev/null; ls -la $OUT
date -u
