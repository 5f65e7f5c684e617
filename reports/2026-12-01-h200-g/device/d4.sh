#!/usr/bin/env bash
# call 4 (issue 12): a fresh build of the final series (25 patches) with the random 14B-1M shape written beside it
# (niced); llama-window-test; the curve gate at the default ubatch and context (auto and off side by side, the copy
# engine), then the same points with the SMs reading the tail (GGML_CUDA_PREFETCH_COPY=sm) and resident
source .carry/env.sh
exec > >(tee $OUT/d4${1:+-$1}.log) 2>&1
stamp start; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
M14=$W/gates/models/qwen2.5-14b-1m-q8_0-s0.gguf
if [ ! -x $P/bin/llama-bench ]; then
  tar xJf .carry/src.tar.xz -C $W; mkdir -p $W/gates/models
  setsid bash -c "nice -n 10 python3 -m rollkv_dist model random -o $M14 --shape qwen2.5-14b-1m --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m14.json 2> $W/m14.log < /dev/null && mv $W/m14.json ${M14%.gguf}.json" > /dev/null 2>&1 < /dev/null &
  stamp build-series; t0=$(date +%s)
  timeout 400 python3 -m rollkv_dist build --source $W/src --prefix $P --variant cuda --cuda-arch 90-real -j 16 --build-dir $W/src/build-cuda 2>&1 | grep -v "^\[" | tail -3
  echo "build series: $(( $(date +%s) - t0 )) s"
  timeout 120 $P/bin/llama-window-test > $REP/window-test-final.log 2>&1; echo "window-test rc=$?"; grep -c PASS $REP/window-test-final.log; grep "FAIL\|flash attention" $REP/window-test-final.log
fi
wait_file ${M14%.gguf}.json 200; cat $W/m14.log | tail -2
if [ "${1:-}" = build ]; then stamp end-build; tar czf $OUT/d4-build.tar.gz -C $W rep; exit 0; fi
C=$REP/d4-curve14b; X=$REP/d4-curve14b-sm; mkdir -p $X
if [ ! -f $C/curve-gpu0.json ]; then
  stamp curve
  timeout 300 python3 -m rollkv_dist gates --build $P --gates curve --gpu 0 --work $W/gates --reports $C --llama-tree $W/src --curve-shape qwen2.5-14b-1m --curve-no-nkvo --curve-fractions 0.5,0.2 --reps 1 2>&1 | tail -4
  tar czf $OUT/d4a.tar.gz -C $W rep
fi
stamp sm
for vt in $(python3 -c "import json,sys; print(' '.join(str(p['vram_target']) for p in json.load(open('$C/curve-gpu0.json'))['results']['points']))"); do
  [ -f $X/sm-$vt.json ] && continue
  GGML_CUDA_PREFETCH_COPY=sm timeout 150 $B -m $M14 -o json -v -fa on -ngl 99 -d 16384 -p 512 -n 64 -r 1 -krm window -vt $vt -kts auto > $X/sm-$vt.json 2> $X/sm-$vt.log
  echo "sm vt=$vt rc=$? $(grep -m1 -o 'position window = [0-9]* / [0-9]*' $X/sm-$vt.log) $(grep -m1 -o 'prefetch copies: .*' $X/sm-$vt.log)"
  timeout 150 $B -m $M14 -o json -v -fa on -ngl 99 -d 16384 -p 512 -n 64 -r 1 -krm window -vt $vt -kts auto > $X/engine-$vt.json 2> $X/engine-$vt.log
  echo "engine vt=$vt rc=$?"
  python3 -c "
import json,sys
for n in ('sm','engine'):
    for r in json.load(open('$X/'+n+'-$vt.json')): print(n, $vt, 'pp' if r['n_prompt'] else 'tg', round(r['avg_ts'],1))"
done
stamp end
tar czf $OUT/d4.tar.gz -C $W rep
