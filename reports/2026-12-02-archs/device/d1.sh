#!/usr/bin/env bash
# call 1 (issue 25): build the series of cea3c79 (before: 25 patches) with upstream's tests, write the fixture's models,
# run every model with the packaged default and with resident
source .carry/env.sh
exec > >(tee $OUT/d1.log) 2>&1
stamp start; nproc; free -m | head -2; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max --format=csv
tar xJf .carry/before.tar.xz -C $W; tar xJf .carry/after.tar.xz -C $W
stamp build-before
t0=$(date +%s)
timeout 480 python3 -m rollkv_dist build --source $W/before --prefix $PB --variant cuda --cuda-arch 90-real -j 16 \
  --build-dir $W/build --targets $TARGETS --cmake-arg=-DLLAMA_BUILD_TESTS=ON 2>&1 | grep -v "^\[" | tail -4
echo "build before: $(( $(date +%s) - t0 )) s"; ls $PB/bin
stamp models
mkdir -p $W/models; $PB/bin/test-llama-archs -o $W/models > $W/writer.log 2>&1; echo "writer rc=$? $(ls $W/models | wc -l) models"
python3 -c "from rollkv_dist.gates.resident_parity import make_prompt; open('$W/prompt.txt','w').write(make_prompt(5000))"
stamp loop-before
python3 .carry/loop.py $PB $W/models $W/prompt.txt $OUT/before.tsv $W/loop-before
(cd $W && tar czf $OUT/loop-before-logs.tar.gz loop-before/*.log loop-before/*.json)
stamp end
