#!/usr/bin/env bash
# calls 4-7 of this lease, sent as one command line each (after `source .carry/env.sh`, the same env as d1-d3)

# call 4: the seed's configuration at -c 524288, auto only (call 2's off,auto run passed its 330 s limit)
timeout 420 python3 -m rollkv_dist gates --build $P --gates curve --gpu 0 --work $W/gates --reports $REP/d4-curve524k-ub4096-auto \
  --llama-tree $W/src --curve-shape qwen2.5-14b-1m --curve-ctx 524288 --curve-ubatch 4096 --curve-staging auto --curve-no-nkvo \
  --curve-fractions 0.75,0.5,0.35,0.2 --reps 1

# call 5: a GGML_CUDA_NO_VMM build of the same tree (its first try passed `--cmake-arg -D...`, which argparse refused)
N=$W/novmm
timeout 330 python3 -m rollkv_dist build --source $W/src --prefix $N --variant cuda --cuda-arch 90-real -j 16 \
  --build-dir $W/src/build-novmm --cmake-arg=-DGGML_CUDA_NO_VMM=ON --targets llama-server,llama-window-test
timeout 60 $N/bin/llama-window-test

# call 6: llama-server on that build (call 5's server runs lacked -fa on)
python3 .carry/server_checks.py $N/bin/llama-server $REP/novmm-window-fits.json novmm-window-fits 60 -m $M -c 8192 -fa on -krm window
python3 .carry/server_checks.py $N/bin/llama-server $REP/novmm-window-tail.json novmm-window-needs-tail 60 -m $M -c 1048576 -fa on -krm window --vram-target 6000
python3 .carry/server_checks.py $N/bin/llama-server $REP/novmm-auto-tail.json novmm-auto-needs-tail 60 -m $M -c 1048576 --vram-target 6000

# call 7: speed at depth 65536 (auto only above --speed-off-max-depth 16384)
timeout 175 python3 -m rollkv_dist gates --build $P --gates speed --speed-depths 65536 --kv-types f16,q8_0 --ubatch-sweep none \
  --gpu 0 --work $W/gates --reports $REP/d7-speed-64k --llama-tree $W/src --reps 2
