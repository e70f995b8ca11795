#!/usr/bin/env bash
# Speed, start time and peak memory at the sizes people run, against llama.cpp's server on the same
# GGUF file, one peer after the other in one invocation each (issue 41, docs/memory.md):
#
#   bash benchmarks/sizes.sh MODEL.gguf /path/to/llama-server [stream,load,prompt]
#
# MODEL.gguf: a shaped random-weight file from benchmarks/make_shaped.py (llama.cpp's own converter
# and quantizer). Three workloads, each a `pytgi bench` run of both servers:
#   stream  one client: 6 requests of 128-256 prompt tokens, 128 generated (ITL)
#   load    16 clients: 32 requests of 64-512 prompt tokens, 64-256 generated (throughput)
#   prompt  one 2,048-token prompt, 8 generated (TTFT)
# Both servers get a 16,384-token KV cache (llama-server: -c 16384, split over its -np slots; pytgi:
# --max-batch-total-tokens 16384) and 2 threads. The bench samples each server's process tree for its
# peak resident memory and times its start (`ready s`, `peak RSS GiB` in the tables). JSON results go
# to benchmarks/results/sizes-<model>-<workload>.json. Tokens are timed and counted by the servers' token
# events (`--count-tokens events`): a random-weight model's tokens often stream as empty text.
#
# GPTQ=DIR (a GPTQ checkpoint of the same model, benchmarks/make_gptq.py) adds a pytgi run on it to each
# workload, right after the GGUF's (issue 43): sizes-<model>-gptq-<workload>.json.
set -euo pipefail
model=$1
llama_server=$2
workloads=${3:-stream,load,prompt}
cd "$(dirname "$0")/.."
name=$(basename "$model" .gguf)
tok=$(.venv/bin/python -c "from pytgi.core.model_files import resolve_model; print(resolve_model('$model', progress=False).path)")
pytgi_args="--model-id $model --max-batch-total-tokens 16384 --max-total-tokens 4096"
run() {  # workload, llama-server flags, bench flags...
    local w=$1 ls_args=$2
    shift 2
    echo "## $name: $w"
    .venv/bin/pytgi bench --peer pytgi --peer "llama-server=$llama_server" --pytgi-args "$pytgi_args" \
        --llama-server-model "$model" --llama-server-args "$ls_args" --tokenizer "$tok" --no-progress \
        --count-tokens events \
        --out "benchmarks/results/sizes-$name-$w.json" "$@"
    if [ -n "${GPTQ:-}" ]; then
        echo "## $name: $w, pytgi on the GPTQ checkpoint $GPTQ"
        .venv/bin/pytgi bench --peer pytgi --pytgi-args "--model-id $GPTQ --max-batch-total-tokens 16384 --max-total-tokens 4096" \
            --tokenizer "$tok" --no-progress --count-tokens events \
            --out "benchmarks/results/sizes-$name-gptq-$w.json" "$@"
    fi
}
for w in ${workloads//,/ }; do
    case $w in
        stream) run stream "-np 1 -c 16384 -t 2" --num-prompts 6 --input-min 128 --input-max 256 \
                    --output-min 128 --output-max 128 --concurrency 1 ;;
        load) run load "-np 16 -c 16384 -t 2" --num-prompts 32 --input-min 64 --input-max 512 \
                    --output-min 64 --output-max 256 --concurrency 16 ;;
        prompt) run prompt "-np 1 -c 16384 -t 2" --num-prompts 1 --input-min 2048 --input-max 2048 \
                    --output-min 8 --output-max 8 --concurrency 1 --warmup 0 ;;
        *) echo "unknown workload $w (stream, load, prompt)" >&2; exit 2 ;;
    esac
done
