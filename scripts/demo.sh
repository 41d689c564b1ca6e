#!/usr/bin/env bash
# The end-to-end demo, offline, on 2 CPU cores (about 13 minutes; DEMO_DURATION=15: shorter):
#   SmolLM2-135M-Instruct (target) + its int8 weight-only copy (the demo draft)
#   convert -> build (calibrate K) -> deploy -> serve -> infer -> verify -> loadtest chat & batch
#   with speculation off / the default policy / forced draft / forced n-gram -> report -> stop.
set -euo pipefail
WORKDIR="${1:-specbuild-work}"
SB="${SPECBUILD:-.venv/bin/specbuild}"
MODEL="demo:smollm2-135m-instruct"
DEMO_DURATION="${DEMO_DURATION:-40}"
HTTP_PORT="${DEMO_HTTP_PORT:-8000}"
export SPECBUILD_WORKDIR="$WORKDIR"

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "1/8 check the pair (same tokenizer, vocab, architecture, sizes)"
"$SB" check --target "$MODEL" --draft "$MODEL"   # the same model twice: warns that the draft is not smaller

step "2/8 convert (normalized safetensors + manifests)"
"$SB" convert --target "$MODEL" --draft "$MODEL"

step "3/8 build the embedded engine: int8 weight-only draft, calibration picks K"
"$SB" build --draft-quantize int8 --max-batch-size 8 --max-seq-len 1024

step "4/8 deploy the Triton model repository"
"$SB" deploy

step "5/8 serve (tritonserver from the nvidia-pytriton wheel, 127.0.0.1)"
"$SB" serve --background --http-port "$HTTP_PORT" --grpc-port $((HTTP_PORT + 1)) --metrics-port $((HTTP_PORT + 2))
trap '"$SB" stop || true' EXIT

step "6/8 one streamed request with speculation"
"$SB" infer --chat --prompt "What is the capital of France?" --num-draft-tokens 4 --max-tokens 48

step "7/8 verify: greedy identical with and without speculation; sampled distribution unchanged"
"$SB" verify -k 4 --max-tokens 32 --seeds 100 --positions 3

step "8/8 load tests: chat and batch; speculation off / the deployment's default policy / forced draft K=4 / forced n-gram"
# Each run lasts at least DEMO_DURATION s and until its profile's min_requests completed (ceiling
# max(4 x duration, duration + 60) s; a slower setting is reported "too slow to measure here").
# The report is written whatever happens; show it, then exit with loadtest's status.
loadtest_status=0
"$SB" loadtest --profile chat --profile batch \
  --setting off:num_draft_tokens=0 --setting policy:default \
  --setting draft:num_draft_tokens=4,proposer=draft --setting ngram:num_draft_tokens=4,proposer=ngram \
  --duration "$DEMO_DURATION" --max-tokens 64 --out "$WORKDIR/report" || loadtest_status=$?

step "done: report in $WORKDIR/report/report.md"
if [ -f "$WORKDIR/report/report.md" ]; then sed -n '1,60p' "$WORKDIR/report/report.md"; fi
exit "$loadtest_status"
