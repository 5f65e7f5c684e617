#!/bin/bash
# call A: build the diagnostic tree (the 39-patch tree + .carry/diag.diff: env-gated switches, default off), then issue 30 runs
set -u
T0=$(date +%s)
R=$PWD; W=/tmp/w; mkdir -p $W $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $W/gpu.txt; cat $W/gpu.txt
if [ ! -x $W/bld/bin/test-backend-ops ]; then
  rm -rf $W/src $W/x && mkdir -p $W/x && tar xf .carry/after.tar.xz -C $W/x && mv $W/x/after $W/src
  (cd $W/src && patch -p1 < $R/.carry/diag.diff) > $W/diag-apply.txt 2>&1 || { echo diag patch failed; cat $W/diag-apply.txt; exit 1; }
  python3 -m rollkv_dist build --source $W/src --prefix $W/prefix --build-dir $W/bld --variant cuda --cuda-arch 90-real -j 16 \
    --targets llama-logits-dump,test-llama-archs,llama-server,llama-window-test,test-backend-ops,llama-perplexity \
    --cmake-arg=-DLLAMA_BUILD_TESTS=ON > $W/build.log 2>&1
  echo "build rc $? at $SECONDS s"; tail -2 $W/build.log
fi
ls $W/bld/bin | tr '\n' ' '; echo
bash .carry/exp.sh $((T0+570)) core plain keep
cd $W && tar czf $OUT/c1.tgz r gpu.txt diag-apply.txt build.log 2>/dev/null; cat $W/r/summary.txt; head -60 $W/r/cudacore.txt 2>/dev/null
