#!/usr/bin/env bash
# final lease (issue 25): the series with 0090-0092 (28 patches), built with upstream's tests, then the archs gate
source .carry/env.sh
exec > >(tee $OUT/d3.log) 2>&1
stamp start; cat .carry/COMMIT
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,memory.used,pcie.link.gen.current,pcie.link.width.current --format=csv
tar xJf .carry/after.tar.xz -C $W
stamp build
t0=$(date +%s)
timeout 330 python3 -m rollkv_dist build --source $W/after --prefix $PA --variant cuda --cuda-arch 90-real -j 16 \
  --build-dir $W/build --targets llama-logits-dump,test-llama-archs --cmake-arg=-DLLAMA_BUILD_TESTS=ON 2>&1 | grep -v "^\[" | tail -3
echo "build: $(( $(date +%s) - t0 )) s"
stamp archs-gate
timeout 250 python3 -m rollkv_dist gates --build $PA --gates archs --gpu 0 --work $W/gates --reports $W/rep \
  --llama-tree $W/after --archs-jobs 14 --archs-filter '^(deepseek32|glm-dsa|hy_v4|dots3note|minimax-m3|qwen35|qwen35moe|qwen3next|jamba|granitehybrid|nemotron_h|nemotron_h_moe|lfm2|lfm2moe|llama|qwen2|gemma3|mamba|kimi-linear|deepseek4|qwen4exp|glm5-next|falcon-h1|plamo2|bailingmoe3|kimi-k3|minimax-01)-' 2>&1 | tail -6 | cut -c1-3000
find $W/gates -name archs.json -exec cp {} $OUT/ \;
stamp end
cd $W && tar czf $OUT/gate.tar.gz --exclude='*.f32' --exclude='*.gguf' rep gates 2>/dev/null; ls -la $OUT
