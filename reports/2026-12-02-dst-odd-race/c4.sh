#!/bin/bash
W=/tmp/w; mkdir -p $W $OUT/c4
if [ ! -x $W/bld/bin/test-backend-ops ]; then
rm -rf $W/src && mkdir -p $W/x && tar xf .carry/after.tar.xz -C $W/x && mv $W/x/after $W/src
python3 -m rollkv_dist build --source $W/src --prefix $W/prefix --build-dir $W/bld --variant cuda --cuda-arch 90-real -j 16 \
  --targets test-backend-ops --cmake-arg=-DLLAMA_BUILD_TESTS=ON > $OUT/c4/build.log 2>&1; tail -1 $OUT/c4/build.log; fi
T=$W/bld/bin/test-backend-ops; export GGML_TEST_WINDOW=dst:odd
for r in nographs-1 nographs-2 control; do
  if [ ${r%-*} = nographs ]; then export GGML_CUDA_DISABLE_GRAPHS=1; else unset GGML_CUDA_DISABLE_GRAPHS; fi
  s=$(date +%s); timeout 120 $T -b CUDA0 -o CPY,DUP,CONT,GET_ROWS,SET_ROWS,FLASH_ATTN_EXT,MUL_MAT,ROPE -j 14 > $OUT/c4/$r.out 2> $OUT/c4/$r.err
  echo "$r rc $? $(( $(date +%s) - s )) s: $(grep -c 'illegal memory' $OUT/c4/$r.err) illegal-access lines; $(grep 'tests passed' $OUT/c4/$r.out | tr -d '\n')"
done
