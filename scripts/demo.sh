#!/usr/bin/env bash
# The end-to-end demo, offline, on 2 CPU cores (about 11 minutes; DEMO_DURATION=15: about 7):
#   SmolLM2-135M-Instruct (target) + its own 4-bit blocks as the draft (the GGUF's Q4_1/Q8_0: the target's weights)
#   convert -> build (calibrate K) -> deploy -> serve -> infer -> verify -> loadtest chat & batch swept over
#   concurrency with speculation off / the default policy / forced draft -> report (gain by load, crossover) -> stop.
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

step "3/8 build the embedded engine: the int4 self-draft (the GGUF's blocks), calibration and the crossover"
"$SB" build --draft-quantize int4 --max-batch-size 8 --max-seq-len 1024

step "4/8 deploy the Triton model repository"
"$SB" deploy

step "5/8 serve (tritonserver from the nvidia-pytriton wheel, 127.0.0.1)"
"$SB" serve --background --http-port "$HTTP_PORT" --grpc-port $((HTTP_PORT + 1)) --metrics-port $((HTTP_PORT + 2))
trap '"$SB" stop || true' EXIT

step "6/8 one streamed request with speculation"
"$SB" infer --chat --prompt "What is the capital of France?" --num-draft-tokens 4 --max-tokens 48

step "7/8 verify: greedy identical with and without speculation; sampled distribution unchanged"
"$SB" verify -k 4 --max-tokens 32 --seeds 100 --positions 3

step "8/8 load tests swept over concurrency: chat and batch; speculation off / the deployment's default policy / forced draft K=4"
# Every setting at every point (chat 1, 2, 4 users; batch 4, 8, 16 on an engine with 8 slots). Each run lasts
# at least DEMO_SWEEP_DURATION s (default DEMO_DURATION / 2) and until DEMO_MIN_REQUESTS completed (ceiling
# max(4 x duration, duration + 60) s; a slower setting is reported "too slow to measure here"). Short points
# on CI: read the curve's shape, not its second digit. The report is written whatever happens; show it, then
# exit with loadtest's status.
SWEEP_DURATION="${DEMO_SWEEP_DURATION:-$(( DEMO_DURATION / 2 > 5 ? DEMO_DURATION / 2 : 5 ))}"
loadtest_status=0
"$SB" loadtest --profile chat --profile batch \
  --sweep "chat:users=${DEMO_CHAT_USERS:-1,2,4,8}" --sweep "batch:users=${DEMO_BATCH_USERS:-2,4,8,16}" \
  --setting off:num_draft_tokens=0 --setting policy:default --setting draft:num_draft_tokens=4,proposer=draft \
  --duration "$SWEEP_DURATION" --min-requests "${DEMO_MIN_REQUESTS:-6}" --max-tokens 64 \
  --out "$WORKDIR/report" || loadtest_status=$?

step "done: report in $WORKDIR/report/report.md"
if [ -f "$WORKDIR/report/report.md" ]; then
  sed -n '/^## Where speculation pays/,/^## Speculation: acceptance/p' "$WORKDIR/report/report.md" | sed '$d'
fi
exit "$loadtest_status"
