#!/bin/bash
# build once, then reproduce the op suite's dst:odd abort with stderr kept
W=/tmp/w; R=$PWD; mkdir -p $W $OUT/c1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/c1/gpu.txt
if [ ! -x $W/prefix/bin/test-backend-ops ]; then
  rm -rf $W/src && mkdir -p $W/x && tar xf .carry/after.tar.xz -C $W/x && mv $W/x/after $W/src
  ( time python3 -m rollkv_dist build --source $W/src --prefix $W/prefix --build-dir $W/bld --variant cuda --cuda-arch 90-real -j 16 \
    --targets llama-logits-dump,test-llama-archs,llama-server,llama-window-test,test-backend-ops,llama-perplexity \
    --cmake-arg=-DLLAMA_BUILD_TESTS=ON ) > $OUT/c1/build.log 2>&1
  tail -5 $OUT/c1/build.log
fi
T=$(ls $W/prefix/bin/test-backend-ops $W/bld/bin/test-backend-ops 2>/dev/null | head -1); echo "suite: $T"
OPS=CPY,DUP,CONT,GET_ROWS,SET_ROWS,FLASH_ATTN_EXT,MUL_MAT,ROPE
for i in 1 2; do
  s=$(date +%s)
  GGML_TEST_WINDOW=dst:odd timeout 200 $T -b CUDA0 -o $OPS -j 14 > $OUT/c1/dstodd-$i.out 2> $OUT/c1/dstodd-$i.err
  echo "run $i rc $? $(( $(date +%s) - s )) s"; tail -3 $OUT/c1/dstodd-$i.out; grep -v "^ggml_cuda\|^  Device\|^load_backend" $OUT/c1/dstodd-$i.err | tail -8
done
