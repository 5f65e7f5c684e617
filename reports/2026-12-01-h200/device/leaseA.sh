#!/usr/bin/env bash
# lease 2, call A: build the series as rollkv builds it, llama-window-test, engine + resident-parity gates,
# llama-server checks of auto mode and the default log lines (1.5B model)
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONPATH=$PWD
W=/tmp/w; REP=$W/rep; mkdir -p $W $REP /tmp/wh $OUT
exec > >(tee $OUT/A.log) 2>&1
date -u; nproc; free -g | head -2; python3 --version; nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used --format=csv; cat .carry/COMMIT
cp .wh1/*.whl /tmp/wh/
tar xJf .carry/src.tar.xz -C $W
t0=$(date +%s)
python3 -m rollkv_dist build --source $W/src --prefix $W/prefix --variant cuda --cuda-arch 90-real -j $(nproc) > $W/build.log 2>&1 || { tail -30 $W/build.log; echo "ROLLKV BUILD FAILED: plain cmake fallback"; cmake -C rollkv_dist/cmake/rollkv.cmake -S $W/src -B $W/b2 -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DCMAKE_INSTALL_PREFIX=$W/prefix > $W/b2.log 2>&1 && cmake --build $W/b2 --target rollkv-programs -j $(nproc) >> $W/b2.log 2>&1 && mkdir -p $W/prefix/bin $W/prefix/lib && cp $W/b2/bin/llama-* $W/prefix/bin/ && cp -P $W/b2/bin/*.so* $W/prefix/lib/ 2>/dev/null; tail -3 $W/b2.log; }
echo "build: $(( $(date +%s) - t0 )) s"; ls $W/prefix/bin $W/prefix/lib | head -30; cp $W/build.log $REP/
$W/prefix/bin/llama-window-test | tee $REP/window-test.txt
timeout 200 python3 -m rollkv_dist gates --build $W/prefix --gates $GATES_A --gpu 0 --work $W/gates --reports $REP/A-gates --llama-tree $W/src 2>&1 | tail -6
M=$W/gates/models/qwen2-1.5b-q8_0-s0.gguf
S=$W/prefix/bin/llama-server
python3 .carry/server_checks.py $S $REP/auto-32k.json auto-32k 90 -m $M -c 32768
python3 .carry/server_checks.py $S $REP/auto-tail.json auto-131k-vt3000 90 -m $M -c 131072 --vram-target 3000
python3 .carry/server_checks.py $S $REP/auto-tail-np1.json auto-131k-vt3000-np1 90 -m $M -c 131072 --vram-target 3000 -np 1
python3 .carry/server_checks.py $S $REP/window-kts.json window-65k-vt2200-kts-on 90 -m $M -c 65536 -fa on -np 1 -krm window --vram-target 2200 -kts on
tar czf $OUT/A.tar.gz -C $W rep
date -u
