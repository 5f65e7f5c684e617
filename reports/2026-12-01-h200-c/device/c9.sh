#!/usr/bin/env bash
# final lease: the channel's CUDA package (offline packer), installed from the channel with py-rattler into a fresh
# prefix; the version gate and resident-parity in auto mode on that installed package
source .carry/env.sh
exec > >(tee $OUT/c9.log) 2>&1
stamp start; cat .carry/COMMIT; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cp .wh3/*.whl /tmp/wh/; python3 -m pip install -q --no-index --find-links /tmp/wh jinja2 pyyaml conda-package-handling py-rattler 2>&1 | tail -2
tar xJf .carry/src.tar.xz -C $W
LBL=$(python3 -c "from rollkv_dist.channel import machine_variants, variant_label; print(variant_label(machine_variants()[-1]))")
stamp "channel $LBL"
A=$W/installed
ROLLKV_CUDA_ARCHITECTURES=90-real timeout 400 python3 -m rollkv_dist channel $W/channel --variant $LBL --builder offline --tree $W/src -j 16 --install $A 2>&1 | tail -12
stamp model
mkdir -p $W/gates/models; python3 -m rollkv_dist model random -o $M --shape qwen2-1.5b --qtype q8_0 --llama-tree $W/src --quiet --json > $W/m15.json && mv $W/m15.json ${M%.gguf}.json
stamp gates
timeout 150 python3 -m rollkv_dist gates --build $A --gates version,resident-parity --parity-mode auto --gpu 0 --work $W/gates --reports $REP/c9-gates --llama-tree $W/src 2>&1 | tail -8
stamp end
tar czf $OUT/c9.tar.gz -C $W rep
