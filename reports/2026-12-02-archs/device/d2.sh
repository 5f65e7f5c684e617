#!/usr/bin/env bash
# call 2 (issue 25): 0090 + 0091 onto the same tree and build dir (only the changed files rebuild: no CUDA kernel),
# the same loop (after), then the archs gate on the after build
source .carry/env.sh
exec > >(tee $OUT/d2.log) 2>&1
stamp start
changed=$(cd $W && diff -rq before after | awk '/^Files/ {print $2}' | sed 's#^before/##')
echo "changed files: $changed"
for f in $changed; do cp $W/after/$f $W/before/$f; done
stamp build-after
t0=$(date +%s)
timeout 300 python3 -m rollkv_dist build --source $W/before --prefix $PA --variant cuda --cuda-arch 90-real -j 16 \
  --build-dir $W/build --targets $TARGETS --cmake-arg=-DLLAMA_BUILD_TESTS=ON 2>&1 | grep -v "^\[" | tail -4
echo "build after: $(( $(date +%s) - t0 )) s"; grep -o '"build_commit": "[^"]*"' $PA/share/rollkv/build-info.json
stamp loop-after
python3 .carry/loop.py $PA $W/models $W/prompt.txt $OUT/after.tsv $W/loop-after
(cd $W && tar czf $OUT/loop-after-logs.tar.gz loop-after/*.log loop-after/*.json)
stamp archs-gate
timeout 420 python3 -m rollkv_dist gates --build $PA --gates archs --gpu 0 --work $W/gates --reports $W/rep \
  --llama-tree $W/before --archs-jobs 12 2>&1 | tail -15
cp $W/gates/archs/archs.json $OUT/ 2>/dev/null || find $W/gates -name archs.json -exec cp {} $OUT/ \;
stamp end
cd $W && tar czf $OUT/gate.tar.gz --exclude='*.f32' --exclude='*.gguf' rep gates 2>/dev/null; ls -la $OUT
