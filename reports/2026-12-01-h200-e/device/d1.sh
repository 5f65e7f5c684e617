#!/usr/bin/env bash
# call 1: build the series (0021 new) and the unpatched pin (llama-bench, for resident-ab); write the 1.5B and
# 14B-1M random models beside the builds (niced); llama-window-test
source .carry/env.sh
exec > >(tee $OUT/d1.log) 2>&1
stamp start; nproc; free -m | head -2; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max --format=csv
tar xJf .carry/src.tar.xz -C $W; tar xJf .carry/up.tar.xz -C $W; mkdir -p $W/gates/models
setsid bash -c "nice -n 10 python3 -m rollkv_dist model random -o $M --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m15.json 2> $W/m15.log < /dev/null && mv $W/m15.json ${M%.gguf}.json; nice -n 10 python3 -m rollkv_dist model random -o $M14 --shape qwen2.5-14b-1m --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m14.json 2> $W/m14.log < /dev/null && mv $W/m14.json ${M14%.gguf}.json" > /dev/null 2>&1 < /dev/null &
stamp build-series
t0=$(date +%s)
timeout 330 python3 -m rollkv_dist build --source $W/src --prefix $P --variant cuda --cuda-arch 90-real -j 16 --build-dir $W/src/build-cuda 2>&1 | grep -v "^\[" | tail -4
echo "build series: $(( $(date +%s) - t0 )) s"; ls $P/bin
stamp build-upstream
t0=$(date +%s)
timeout 240 python3 -m rollkv_dist build --source $W/up --prefix $U --variant cuda --cuda-arch 90-real -j 16 --build-dir $W/up/build-cuda --targets llama-bench 2>&1 | grep -v "^\[" | tail -4
echo "build upstream: $(( $(date +%s) - t0 )) s"; ls $U/bin
stamp window-test
timeout 120 $P/bin/llama-window-test > $REP/window-test.log 2>&1; echo "rc=$?"; tail -6 $REP/window-test.log
wait_file ${M%.gguf}.json 60; tail -2 $W/m14.log
stamp end
tar czf $OUT/d1.tar.gz -C $W rep
