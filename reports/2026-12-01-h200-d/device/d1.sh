#!/usr/bin/env bash
# call 1: build the series (0016-0019 new), models, engine (llama-window-test incl. teardown-under-capture),
# resident-parity (f16/q8_0; auto now stages f16 decode with prefetch), speed with prefetch off (env) and on
source .carry/env.sh
exec > >(tee $OUT/d1.log) 2>&1
stamp start; nproc; free -m | head -2; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current --format=csv
cp .wh1/*.whl /tmp/wh/; python3 -m pip install -q --no-index --find-links /tmp/wh matplotlib 2>&1 | tail -1
tar xJf .carry/src.tar.xz -C $W; mkdir -p $W/gates/models
# the 14B-1M shape for call 2, written beside the build (niced, one core); the speed runs wait for it
setsid bash -c "nice -n 10 python3 -m rollkv_dist model random -o $M14 --shape qwen2.5-14b-1m --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m14.json 2> $W/m14.log < /dev/null && mv $W/m14.json ${M14%.gguf}.json" > /dev/null 2>&1 < /dev/null &
stamp build
t0=$(date +%s)
timeout 420 python3 -m rollkv_dist build --source $W/src --prefix $P --variant cuda --cuda-arch 90-real -j 16 --build-dir $BD 2>&1 | grep -v "^\[" | tail -6
echo "build: $(( $(date +%s) - t0 )) s"; ls $P/bin
stamp model
python3 -m rollkv_dist model random -o $M --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m15.json && mv $W/m15.json ${M%.gguf}.json
stamp window-test
timeout 120 $P/bin/llama-window-test 2>&1 | tee $REP/window-test.log | tail -25
stamp gates-engine-parity
timeout 200 python3 -m rollkv_dist gates --build $P --gates engine,resident-parity --gpu 0 --work $W/gates --reports $REP/d1-parity --llama-tree $W/src 2>&1 | tail -8
tar czf $OUT/d1a.tar.gz -C $W rep --exclude='*.f32'
stamp wait-m14; wait_m14 240
stamp speed-prefetch-off
GGML_CUDA_WINDOW_PREFETCH=0 timeout 150 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 16384 --ubatch-sweep none --gpu 0 --work $W/gates --reports $REP/d1-speed-serial --llama-tree $W/src 2>&1 | tail -4
stamp speed-prefetch-on
timeout 150 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 16384 --ubatch-sweep none --gpu 0 --work $W/gates --reports $REP/d1-speed-prefetch --llama-tree $W/src 2>&1 | tail -4
stamp end
tar czf $OUT/d1.tar.gz -C $W rep --exclude='*.f32'
