#!/usr/bin/env bash
# call 1: build the series (0022 new); write the 1.5B random model beside the build (niced); llama-window-test with
# 0022's default and with each of its settings
source .carry/env.sh
exec > >(tee $OUT/d1.log) 2>&1
stamp start; nproc; free -m | head -2; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max --format=csv
tar xJf .carry/src.tar.xz -C $W; mkdir -p $W/gates/models
setsid bash -c "nice -n 10 python3 -m rollkv_dist model random -o $M --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m15.json 2> $W/m15.log < /dev/null && mv $W/m15.json ${M%.gguf}.json" > /dev/null 2>&1 < /dev/null &
stamp build-series
t0=$(date +%s)
timeout 420 python3 -m rollkv_dist build --source $W/src --prefix $P --variant cuda --cuda-arch 90-real -j 16 --build-dir $W/src/build-cuda 2>&1 | grep -v "^\[" | tail -4
echo "build series: $(( $(date +%s) - t0 )) s"; ls $P/bin
stamp window-test
timeout 120 $P/bin/llama-window-test > $REP/window-test.log 2>&1; echo "rc=$?"; grep -c PASS $REP/window-test.log; grep -v "^PASS" $REP/window-test.log | tail -8; grep "flash attention" $REP/window-test.log
for cfg in "side 0" "join 0" "join 1" "stream 1"; do set -- $cfg
  stamp window-test-$1-group$2
  GGML_CUDA_PREFETCH_DEVICE_CELLS=$1 GGML_CUDA_PREFETCH_GROUP=$2 timeout 120 $P/bin/llama-window-test > $REP/window-test-$1-group$2.log 2>&1; echo "rc=$?"; grep -c PASS $REP/window-test-$1-group$2.log; grep "flash attention\|FAIL\|prefetch copies" $REP/window-test-$1-group$2.log
done
GGML_CUDA_PREFETCH_DEVICE_CELLS=tail GGML_CUDA_PREFETCH_GROUP=2 timeout 60 $P/bin/llama-window-test > $REP/window-test-badenv.log 2>&1; echo "rc=$?"; grep "prefetch" $REP/window-test-badenv.log
wait_file ${M%.gguf}.json 60
stamp end
tar czf $OUT/d1.tar.gz -C $W rep
