#!/usr/bin/env bash
# lease 2, call B: the README's first command as written, offline (wheelhouse), with the build of call A and
# ROLLKV_GATES=speed: the speed gate at depth 16384 (before/after tail staging, f16 and q8_0, ubatch sweep)
set -u
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
W=/tmp/w; REP=$W/rep; mkdir -p $REP $OUT
exec > >(tee $OUT/B.log) 2>&1
date -u; cp .wh2/*.whl /tmp/wh/; ls /tmp/wh | wc -l
# window-test's op context was too small for three graphs (abort in call A): fix, rebuild that target, rerun the engine gate
sed -i 's/ggml_tensor_overhead()\*64 + ggml_graph_overhead()\*2/ggml_tensor_overhead()*64 + ggml_graph_overhead()*4/' $W/src/tools/window-test/window-test.cpp
grep -c "ggml_graph_overhead()\*4" $W/src/tools/window-test/window-test.cpp
(cd $W/src/build-cuda && ninja llama-window-test > /dev/null) && cp $W/src/build-cuda/bin/llama-window-test $W/prefix/bin/ && $W/prefix/bin/llama-window-test | tee $REP/window-test-fixed.txt
PYTHONPATH=$PWD timeout 60 python3 -m rollkv_dist gates --build $W/prefix --gates engine --gpu 0 --work $W/gates --reports $REP/B-engine --llama-tree $W/src 2>&1 | tail -3
export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wh ROLLKV_BUILD=$W/prefix ROLLKV_LLAMA_TREE=$W/src ROLLKV_GATES=speed ROLLKV_ARTIFACTS=source ROLLKV_REPORTS=$REP/B-speed16k
t0=$(date +%s)
timeout 560 bash -c 'python3 -m pip install nox && nox -s gpu_gates -- --speed-depths 16384 --reps 3' ; echo "README command rc=$? in $(( $(date +%s) - t0 )) s"
tar czf $OUT/B.tar.gz -C $W rep/B-speed16k rep/B-engine rep/window-test-fixed.txt
date -u
