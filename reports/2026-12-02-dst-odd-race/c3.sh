#!/bin/bash
W=/tmp/w; mkdir -p $W $OUT/c3
rm -rf $W/src && mkdir -p $W/x && tar xf .carry/after.tar.xz -C $W/x && mv $W/x/after $W/src
( time python3 -m rollkv_dist build --source $W/src --prefix $W/prefix --build-dir $W/bld --variant cuda --cuda-arch 90-real -j 16 \
  --targets test-backend-ops --cmake-arg=-DLLAMA_BUILD_TESTS=ON ) > $OUT/c3/build.log 2>&1; tail -3 $OUT/c3/build.log
T=$W/bld/bin/test-backend-ops
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1); echo "sanitizer: $CS"
export GGML_TEST_WINDOW=dst:odd
timeout 60 $T -b CUDA0 -o FLASH_ATTN_EXT -p "type_K=q5_1" > $OUT/c3/fa-q51.out 2> $OUT/c3/fa-q51.err; echo "fa q5_1 -j1 rc $?"; tail -2 $OUT/c3/fa-q51.out
if [ -n "$CS" ]; then
  timeout 150 $CS --tool memcheck --print-limit 20 $T -b CUDA0 -o FLASH_ATTN_EXT -p "type_K=q5_1.*nb=(1|3)," > $OUT/c3/memcheck.out 2>&1; echo "memcheck rc $?"
  grep -m1 -B2 -A25 "Invalid\|ERROR SUMMARY" $OUT/c3/memcheck.out | head -50
fi
CUDA_LAUNCH_BLOCKING=1 timeout 150 $T -b CUDA0 -o CPY,DUP,CONT,GET_ROWS,SET_ROWS,FLASH_ATTN_EXT,MUL_MAT,ROPE -j 14 > $OUT/c3/blocking.out 2> $OUT/c3/blocking.err; echo "blocking rc $?"
grep -v "window buffer: \|warmup" $OUT/c3/blocking.err | head -12; tail -2 $OUT/c3/blocking.out
