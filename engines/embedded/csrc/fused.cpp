// specbuild fused CPU decode step: the embedded engine's transformer layers in one call, and block-quantized
// GEMV kernels (Q4_1, Q8_0: the GGUF block layouts) for a cheap self-draft. Built by `make setup` through
// torch.utils.cpp_extension (engines/embedded/fused.py); the engine falls back to eager PyTorch without it.
//
// Why: a decode step of a small model in eager PyTorch is ~750 ATen calls from Python (norms, RoPE, cache
// writes, attention, activations: ~15-20 us each of dispatch around microseconds of work). Here one call runs
// every layer: the fp32 linears go to the tiled kernel below (or oneDNN, where it measured faster: step.py), the
// quantized ones to the block kernels below, the rest are plain loops over the rows, with the GIL released for the
// whole forward.
//
// Rows are ragged: row r is token r of some sequence, written to KV-cache slot `slots[r]` at position `pos[r]`,
// attending to positions 0..pos[r] of that slot. Every row's K/V of a layer is written before that layer's
// attention, so rows of one sequence in the same call see each other (a verify of [last, d1..dK], a prefill).
// No padding, no masks.
//
// Numerics: built with -ffp-contract=off, so a block weight is dequantized exactly as gguf-py / transformers do
// it (d * q, then + m, each rounded to fp32) and a kernel's product x * w is the one the fp32 target computes
// with its (dequantized) weight. Each output is a dot product in one fixed order whatever the number of rows,
// so a row's result does not depend on the other rows of the batch (batch invariance).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <immintrin.h>
#include <pthread.h>

namespace {

// ---- the kernels' own worker pool -------------------------------------------------------------------------------
// Not at::parallel_for: libgomp counts the workers of every thread that ever ran a parallel region, and once that
// count passes the CPUs (the main thread loaded the engine, then a serving thread steps it: 2 + 2 on 2 CPUs) every
// worker spins only ~100 iterations before it sleeps, so each of a step's ~200 parallel loops waited on a futex
// wake-up: the same step ran 1.45x (target) to 2.5x (int4 draft) slower in the serving thread than in the thread
// that loaded it (bench/README.md "2026-12-04 evening"). These workers are the kernels' own: whichever thread
// calls, they spin for up to SPIN_US after a loop (a decode step's loops follow each other by microseconds; a
// longer spin would take a core from a oneDNN linear between them), then sleep on a condition variable: at most
// one wake-up a step. One loop at a time: a second caller, or a loop inside a loop, runs serially.
class Pool {
 public:
  static constexpr int64_t SPIN_US = 100;

  static Pool& get() {
    Pool* p = instance().load(std::memory_order_acquire);
    if (p != nullptr) return *p;
    static std::once_flag once;           // a forked child has none of the workers: it makes its own pool
    std::call_once(once, [] {
      pthread_atfork(nullptr, nullptr, [] { instance().store(nullptr); creating() = new std::mutex; });
    });
    std::lock_guard<std::mutex> lk(*creating());
    p = instance().load(std::memory_order_acquire);
    if (p == nullptr) {
      p = new Pool(std::max(0, at::get_num_threads() - 1));   // never freed: no teardown at exit
      instance().store(p, std::memory_order_release);
    }
    return *p;
  }

  // f(a, b) over [begin, end) in at most at::get_num_threads() chunks of at least `grain` (at::parallel_for's split)
  template <class F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t range = end - begin;
    if (range <= 0) return;
    const int64_t want = std::min<int64_t>({static_cast<int64_t>(at::get_num_threads()),
                                            static_cast<int64_t>(workers_.size()) + 1,
                                            (range + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1)});
    if (want <= 1 || in_worker() || !busy_.try_lock()) {
      f(begin, end);
      return;
    }
    const int64_t chunk = (range + want - 1) / want;
    std::function<void(int64_t)> body = [&](int64_t t) {
      const int64_t a = begin + t * chunk, b = std::min(end, a + chunk);
      if (a < b) f(a, b);
    };
    error_ = nullptr;
    task_ = &body;
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_seq_cst);
    gen_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(m_);
      cv_.notify_all();
    }
    std::exception_ptr mine;
    try {
      body(0);
    } catch (...) {
      mine = std::current_exception();
    }
    while (pending_.load(std::memory_order_acquire) > 0) _mm_pause();   // body lives on this stack: wait for all
    task_ = nullptr;
    std::exception_ptr theirs = error_;
    busy_.unlock();
    if (mine) std::rethrow_exception(mine);
    if (theirs) std::rethrow_exception(theirs);
  }

 private:
  explicit Pool(int n) {
    for (int i = 0; i < n; i++) workers_.emplace_back([this, i] { loop(i); });
    for (auto& w : workers_) w.detach();
  }

  static std::atomic<Pool*>& instance() {
    static std::atomic<Pool*> p{nullptr};
    return p;
  }

  static std::mutex*& creating() {
    static std::mutex* m = new std::mutex;
    return m;
  }

  static bool& in_worker() {
    static thread_local bool w = false;
    return w;
  }

  void loop(int i) {
    in_worker() = true;
    uint64_t seen = 0;      // the generation at construction: a loop posted before this thread ran is still run
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      uint64_t g;
      for (uint32_t spins = 1; (g = gen_.load(std::memory_order_acquire)) == seen; spins++) {
        _mm_pause();
        if (spins % 256 == 0 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(SPIN_US)) {
          std::unique_lock<std::mutex> lk(m_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          cv_.wait(lk, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          t0 = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      try {
        (*task_)(i + 1);      // chunk 0 is the caller's; a chunk past the range is empty
      } catch (...) {
        std::lock_guard<std::mutex> lk(m_);
        if (!error_) error_ = std::current_exception();
      }
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleepers_{0};
  std::function<void(int64_t)>* task_ = nullptr;
  std::exception_ptr error_;
  std::mutex m_, busy_;
  std::condition_variable cv_;
};

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Pool::get().run(begin, end, grain, f);
}

// AVX2 + FMA (x86-64 since 2013; where they are missing the build fails and the engine runs eager PyTorch).

inline float hsum8(__m256 v) {                   // one fixed order: ((0+1)+(2+3)) + ((4+5)+(6+7))
  alignas(32) float a[8];
  _mm256_store_ps(a, v);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// dot of two float vectors of length n (n % 8 == 0), one fixed order
inline float dot8(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  return hsum8(acc);
}

// lane j = hsum8(a[j]): per lane the same additions in the same order, ((0+1)+(2+3)) + ((4+5)+(6+7)) (hadd's
// pairs, then the 128-bit halves), for 8 sums at the cost of 7 shuffling adds instead of 8 stores and 56 scalar ones
inline __m256 hsum8x8(const __m256* a) {
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 g2 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g1, g2, 0x20), _mm256_permute2f128_ps(g1, g2, 0x31));
}

// dot8(q, k + (p0 + j) * ld, n) for j = 0..7 as one vector, bitwise: each lane is one position's chain and sum
inline __m256 dot8x8(const float* q, const float* k, int64_t ld, int64_t n) {
  __m256 acc[8];
  for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * ld + i), acc[j]);
  }
  return hsum8x8(acc);
}

// exp(x) for 8 floats: 2^n * 2^f, f in [-0.5, 0.5], a degree-6 polynomial (relative error ~2e-7); exp(-inf) = 0
inline __m256 exp8(__m256 x) {
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-103.0f));
  __m256 t = _mm256_mul_ps(x, log2e);
  __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(t, n);                                        // 2^f, f in [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 scale = _mm256_castsi256_ps(e);
  __m256 out = _mm256_mul_ps(p, scale);
  return _mm256_and_ps(out, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));   // underflow: 0
}

constexpr int64_t QK = 32;        // block size of Q4_1 and Q8_0

// ---- block dequantization: exactly gguf-py's (d * q) + m in fp32 (a multiply, then an add: no fma) ----------
inline void dequant_q4_1(const uint8_t* qs, float d, float m, __m256 w[4]) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(b, mask);                       // byte j: element j (low nibble), j + 16 (high)
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; j++)
    w[j] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), dv), mv);
}

inline void dequant_q8_0(const int8_t* qs, float d, __m256 w[4]) {
  const __m256 dv = _mm256_set1_ps(d);
  for (int j = 0; j < 4; j++) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j));
    w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), dv);
  }
}

// A row's dot product with a block-quantized weight row runs in 4 independent chains of vector accumulators (one
// chain would wait on every fma's latency), summed in one fixed order at the end: the same for any number of rows.
// The AVX-512 form holds a block in two 16-float vectors (chains: vector j of even / odd blocks), the AVX2 form in
// four 8-float ones (chain = vector j), so a machine's results depend on its build only.
// Vec: the float vector every kernel below computes with (16 floats with AVX-512 F + BW, else 8).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SPECBUILD_AVX512 1
#endif
#ifdef SPECBUILD_AVX512
typedef __m512 Vec;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline float vsum(Vec a) {
  alignas(64) float v[16];
  _mm512_store_ps(v, a);
  float s[8];
  for (int i = 0; i < 8; i++) s[i] = v[i] + v[i + 8];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}
constexpr int VW = 16, VPB = 2;                  // floats per vector, vectors per block
inline void block_q4_1(const uint8_t* qs, float d, float m, Vec* w) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(15);
  const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
  w[0] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), dv), mv);
  w[1] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask))), dv), mv);
}
inline void block_q8_0(const int8_t* qs, float d, Vec* w) {
  const __m512 dv = _mm512_set1_ps(d);
  for (int j = 0; j < 2; j++)
    w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * j)))), dv);
}
inline int chain(int64_t b, int j) { return static_cast<int>((b & 1) * 2 + j); }
#else
typedef __m256 Vec;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline float vsum(Vec a) { return hsum8(a); }
constexpr int VW = 8, VPB = 4;
inline void block_q4_1(const uint8_t* qs, float d, float m, Vec* w) { dequant_q4_1(qs, d, m, w); }
inline void block_q8_0(const int8_t* qs, float d, Vec* w) { dequant_q8_0(qs, d, w); }
inline int chain(int64_t, int j) { return j; }
#endif

inline float chains_sum(const Vec* c) { return vsum(vadd(vadd(c[0], c[1]), vadd(c[2], c[3]))); }

// y[M, N] = x[M, K] @ W^T (+ bias) for a block-quantized W [N, K]; `kind` 1 = Q4_1, 2 = Q8_0.
// qs: Q4_1 uint8 [N, K/32, 16] | Q8_0 int8 [N, K/32, 32]; d (and m for Q4_1): float32 [N, K/32].
void block_gemm(int kind, const float* x, int64_t M, int64_t K, const void* qs, const float* d, const float* m,
                const float* bias, float* y, int64_t N) {
  const int64_t nb = K / QK;
  const int64_t qbytes = kind == 1 ? 16 : 32;
  parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
      const uint8_t* q = static_cast<const uint8_t*>(qs) + n * nb * qbytes;
      const float* dn = d + n * nb;
      const float* mn = kind == 1 ? m + n * nb : nullptr;
      // Rows in groups of at most 4: each block is dequantized once per group into registers and used for every
      // row of the group, so a group runs 4 rows x 4 chains of independent fmas (one row alone would wait on the
      // fma latency of its 4 chains). A row's result is the same whatever its group: its own chains, one order.
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, M - r0);
        const float* xg = x + r0 * K;
        Vec acc[4][4];
        for (int64_t r = 0; r < rows; r++)
          for (int c = 0; c < 4; c++) acc[r][c] = vzero();
        for (int64_t b = 0; b < nb; b++) {
          Vec w[VPB];
          if (kind == 1) block_q4_1(q + b * qbytes, dn[b], mn[b], w);
          else block_q8_0(reinterpret_cast<const int8_t*>(q + b * qbytes), dn[b], w);
          for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < VPB; j++) {
              Vec& a = acc[r][chain(b, j)];
              a = vfma(w[j], vload(xg + r * K + b * QK + j * VW), a);
            }
        }
        for (int64_t r = 0; r < rows; r++) y[(r0 + r) * N + n] = chains_sum(acc[r]) + (bias ? bias[n] : 0.f);
      }
    }
  });
}

// ---- block weights with int8 activations (a draft's fast path: kinds Q4_1_Q8, Q8_0_Q8) ----------------------
// As llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 dots: each row of x is quantized per block of 32 to int8 (xd = max|x| /
// 127, xq = round(x / xd)), the block dot runs in integers, and  y = sum_b (d_b xd_b) <q_b, xq_b>  (+ sum_b m_b s_b
// for Q4_1, s_b = the block's sum of x in fp32). Not the target's numbers: x is rounded to 8 bits, so a draft on it
// is an approximation of the target (its acceptance is measured; verify keeps the output exact).
//
// The weights are interleaved by 16 output rows (blocks.interleave_blocks): for a group of 16 rows and a block,
// 4 (Q4_1) or 8 (Q8_0) vectors of 64 bytes, vector s holding each row's 4 bytes of the block at s (Q4_1: elements
// 4s..4s+3 in the low nibbles, 16+4s.. in the high ones, as GGUF packs them; Q8_0: elements 4s..4s+3), and the 16
// rows' d (and m) of a block side by side, in fp16 as GGUF stores them (exact for blocks recovered from a GGUF,
// rounded otherwise: blocks._half). A Q4_1 block is then 20 bytes, not 24 with fp32 scales: the SmolLM2-135M int4
// draft's layers, 1 row, AMD EPYC Zen 4, 2 threads, median of 5 x 9 interleaved, 3.10 -> 2.64 ms at context 1 and
// 3.60 -> 3.13 at context 300 (the same bits); its Q8_0 lm_head (34 bytes a block, not 36) 1.13 -> 1.02 ms. One x row's 4 int8 values, broadcast, times such a vector gives 16 rows'
// partial dots in 16 int32 lanes (VNNI's dpbusd: 4 products a lane; else maddubs + madd), so a block costs per x
// row 8 integer dots for 16 rows and one fma for their scales: no horizontal sums, no per-row scalar work (the
// per-output-row kernel this replaced spent most of its time there). The SmolLM2-135M int4 draft step, AMD EPYC
// Zen 4 (AVX-512 VNNI), 2 threads: 6.5 / 8.0 / 12.8 / 23.6 -> 5.4 / 6.0 / 8.0 / 14.9 ms at 1 / 2 / 4 / 8 rows.
// Every output is one fixed sequence of operations, the same whatever the number of rows or their tiles: a row's
// result does not depend on the other rows. AVX2 runs the same layout as two halves of 8 rows.
struct QRow {                      // one quantized row of x: K int8 in element order, per block its scale and sum
  const int8_t* q;
  const float* d;
  const float* s;
  const uint8_t* u;                // q + 128 as unsigned bytes (q ^ 0x80): the Q8_0 kernel's VNNI operand
};

// x's row -> q (K int8: round(x * 127 / amax) per block of 32, half to even), d (amax / 127) and s (the block's
// sum, in one fixed order: ((v0 + v1) + (v2 + v3)) of its 4 vectors, then hsum8), vectorized: the scalar loop it
// replaced chained 32 dependent adds a block and ran on the calling thread before the threads split the outputs
// (with 4 vector allocations a call): 0.75 ms of a 6 ms int4 draft step at 1 row (perf, Intel Xeon).
inline void quantize_row_q8(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);     // packs' lane interleave, undone
  for (int64_t b = 0; b < K / QK; b++) {
    const float* xb = x + b * QK;
    const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    const __m256 am = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                    _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
    alignas(32) float a8[8];
    _mm256_store_ps(a8, am);
    float amax = 0.f;
    for (int j = 0; j < 8; j++) amax = std::max(amax, a8[j]);
    const float dd = amax / 127.f, inv = dd > 0.f ? 127.f / amax : 0.f;
    d[b] = dd;
    s[b] = hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    const __m256 iv = _mm256_set1_ps(inv);                 // cvtps: round to nearest even, as nearbyint
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, iv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, iv));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, iv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, iv));
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
  }
}

// Q8_0 on VNNI: vpdpbusd multiplies unsigned bytes by signed ones, and both Q8_0 operands are signed. Each row's
// x goes in as x + 128 (QRow::u) beside the signed weights, and 128 times the weights' sum (one more vpdpbusd a
// step, against all-ones, shared by the tile's rows) comes off once a block: the same int32 per lane as the
// sign-moved product it replaces (|sum| <= 32 x 255 x 127: no overflow), so the same outputs, bitwise, without a
// masked byte subtraction per row and step. The target's Q8_0 head screen (49152 x 576), AMD EPYC Zen 4, 2 threads,
// medians of 15 interleaved, 3 alternating processes each: 9 rows 2.42-2.56 -> 1.35-1.62 ms, 36 rows 9.97-10.54
// -> 4.66-5.39 ms, 1 row 1.07-1.15 -> 0.99-1.18 ms (memory-bound); a 4 x 9-row verify 55.5-57.6 -> 48.4-55.3 ms.
#if defined(SPECBUILD_AVX512) && defined(__AVX512VNNI__)
constexpr bool Q8_UNSIGNED_X = true;
#else
constexpr bool Q8_UNSIGNED_X = false;   // maddubs (no VNNI) saturates 16-bit pairs: (x + 128) w would not fit
#endif

// The quantized rows of one call, in buffers of the calling thread kept between calls (no allocation a call)
struct QRows {
  std::vector<int8_t> q;
  std::vector<uint8_t> u;
  std::vector<float> d, s;
  std::vector<QRow> rows;
  // unsigned_x: also each row's x + 128 (QRow::u; nullptr otherwise), which only the Q8_0 kernel on VNNI reads
  const QRow* quantize(const float* x, int64_t M, int64_t K, bool unsigned_x) {
    const int64_t nb = K / QK;
    if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
    if (unsigned_x && static_cast<int64_t>(u.size()) < M * K) u.resize(M * K);
    if (static_cast<int64_t>(d.size()) < M * nb) { d.resize(M * nb); s.resize(M * nb); }
    rows.resize(M);
    for (int64_t r = 0; r < M; r++) {
      int8_t* qr = q.data() + r * K;
      uint8_t* ur = unsigned_x ? u.data() + r * K : nullptr;
      quantize_row_q8(x + r * K, K, qr, d.data() + r * nb, s.data() + r * nb);
      for (int64_t i = 0; unsigned_x && i < K; i += 32)    // q + 128, unsigned: the byte's top bit flipped
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ur + i),
                            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qr + i)),
                                             _mm256_set1_epi8(static_cast<char>(0x80))));
      rows[r] = QRow{qr, d.data() + r * nb, s.data() + r * nb, ur};
    }
    return rows.data();
  }
};

constexpr int64_t IGROUP = 16;              // output rows interleaved together
// The int8 kernel prefetches the weights and scales Q8_PREFETCH blocks ahead (6-12 KB; a group's blocks are
// contiguous and so are the groups, so it runs into the next group) into L2. The int4 draft's step on an Intel
// Xeon, 2 threads, context 200, median of 11 interleaved: 5.75 -> 4.98 ms at 1 row, 10.22 -> 8.58 at 4, 16.05 ->
// 14.43 at 8 (the hardware prefetcher alone left the integer dots waiting on memory, and the dots then left the
// memory idle). Prefetches never fault: past the last block they fetch nothing of use.
constexpr int64_t Q8_PREFETCH = 24;

#ifdef SPECBUILD_AVX512
typedef __m512i IV;                          // int32 lanes: one per output row of the group
constexpr int IV_ROWS = 16, IQ_ROWS = 4;     // rows a vector holds; x rows a tile takes
inline IV iv_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IV iv_zero() { return _mm512_setzero_si512(); }
inline IV iv_x4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline IV iv_lo(IV w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
inline IV iv_hi(IV w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15)); }
inline IV iv_add(IV a, IV b) { return _mm512_add_epi32(a, b); }
inline IV iv_sub(IV a, IV b) { return _mm512_sub_epi32(a, b); }
inline IV iv_shl7(IV a) { return _mm512_slli_epi32(a, 7); }
inline IV iv_ones8() { return _mm512_set1_epi8(1); }
// acc + per lane the dot of 4 unsigned weight bytes with 4 signed x bytes (|w| <= 127: no s16 saturation)
inline IV iv_dot(IV acc, IV w_u8, IV x_s8) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w_u8, x_s8);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w_u8, x_s8), _mm512_set1_epi16(1)));
#endif
}
struct SignedW { IV abs; __mmask64 neg; };   // a signed weight vector as |w| and where w < 0
inline SignedW iv_signed(IV w) { return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)}; }
inline IV iv_dot_signed(IV acc, const SignedW& w, IV x) {     // |w| x (x with w's sign): the same products
  return iv_dot(acc, w.abs, _mm512_mask_sub_epi8(x, w.neg, _mm512_setzero_si512(), x));
}
inline Vec vcvt(IV v) { return _mm512_cvtepi32_ps(v); }
#if defined(__AVX512VNNI__)
constexpr bool IV_DOT16 = false;
inline IV iv_dot16(IV a, IV, IV) { return a; }
inline IV iv_widen16(IV a) { return a; }
#else                                        // as AVX2's below
constexpr bool IV_DOT16 = true;
inline IV iv_dot16(IV acc16, IV w_u8, IV x_s8) { return _mm512_add_epi16(acc16, _mm512_maddubs_epi16(w_u8, x_s8)); }
inline IV iv_widen16(IV s16) { return _mm512_madd_epi16(s16, _mm512_set1_epi16(1)); }
#endif
#else
typedef __m256i IV;
constexpr int IV_ROWS = 8, IQ_ROWS = 2;
inline IV iv_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IV iv_zero() { return _mm256_setzero_si256(); }
inline IV iv_x4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline IV iv_lo(IV w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
inline IV iv_hi(IV w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15)); }
inline IV iv_add(IV a, IV b) { return _mm256_add_epi32(a, b); }
inline IV iv_sub(IV a, IV b) { return _mm256_sub_epi32(a, b); }
inline IV iv_shl7(IV a) { return _mm256_slli_epi32(a, 7); }
inline IV iv_ones8() { return _mm256_set1_epi8(1); }
inline IV iv_dot(IV acc, IV w_u8, IV x_s8) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w_u8, x_s8), _mm256_set1_epi16(1)));
}
struct SignedW { IV w, abs; };
inline SignedW iv_signed(IV w) { return {w, _mm256_sign_epi8(w, w)}; }
inline IV iv_dot_signed(IV acc, const SignedW& w, IV x) { return iv_dot(acc, w.abs, _mm256_sign_epi8(x, w.w)); }
inline Vec vcvt(IV v) { return _mm256_cvtepi32_ps(v); }
// Without VNNI a Q4_1 block's byte products are summed in 16-bit lanes (maddubs, then adds) and widened once a
// block: 16 products of at most 15 x 127 a lane, 30480 <= 32767, so the integers (and the outputs) are the same.
// The int4 draft's linears (a 30-layer 576-wide model), AVX2 build on an Intel Xeon, 2 threads, medians of 3
// processes: 1 row 2.51 -> 2.07 ms, 2 rows 2.92 -> 2.45, 4 rows 4.96 -> 4.40, 8 rows 9.46 -> 8.10 (bench/README.md,
// "2026-12-06 evening"). Q8_0's products reach 127 x 127: it keeps the 32-bit sums.
constexpr bool IV_DOT16 = true;
inline IV iv_dot16(IV acc16, IV w_u8, IV x_s8) { return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w_u8, x_s8)); }
inline IV iv_widen16(IV s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
#endif

// IV_ROWS fp16 scales -> a vector of fp32 (F16C's vcvtph2ps: exact)
#ifdef SPECBUILD_AVX512
inline Vec vload_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#else
inline Vec vload_half(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// MR x rows against IV_ROWS output rows starting at row `half * IV_ROWS` of an interleaved group: q, d, m point at
// the group's blocks (q: nb x STEPS x 64 bytes, d / m: nb x 16 fp16). out[r * ldo + j], j < IV_ROWS.
template <int KIND, int MR>
inline void q8_group_tile(const uint8_t* q, const uint16_t* d, const uint16_t* m, const QRow* const* xr, int64_t nb,
                          int half, float* out, int64_t ldo) {
  constexpr int STEPS = KIND == 1 ? 4 : 8;                      // 64-byte vectors per block of the group
  const int64_t off = half * IV_ROWS;                           // rows: bytes 4 * off.. of a vector, scales off..
  Vec acc[MR], macc[MR];
  for (int r = 0; r < MR; r++) acc[r] = macc[r] = vzero();
  const IV ones = iv_ones8();
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* qb = q + b * STEPS * 64 + 4 * off;
    for (int st = 0; st < STEPS; st++)                          // block b + Q8_PREFETCH's weights and scales
      _mm_prefetch(reinterpret_cast<const char*>(q + (b + Q8_PREFETCH) * STEPS * 64 + st * 64), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(d + (b + Q8_PREFETCH) * IGROUP), _MM_HINT_T1);
    if (KIND == 1) _mm_prefetch(reinterpret_cast<const char*>(m + (b + Q8_PREFETCH) * IGROUP), _MM_HINT_T1);
    IV lo[MR], hi[MR], wsum = iv_zero();
    for (int r = 0; r < MR; r++) lo[r] = hi[r] = iv_zero();
    if (KIND == 1 && IV_DOT16) {
      IV s16[MR];
      for (int r = 0; r < MR; r++) s16[r] = iv_zero();
      for (int st = 0; st < STEPS; st++) {
        const IV w = iv_load(qb + st * 64);
        const IV wl = iv_lo(w), wh = iv_hi(w);
        for (int r = 0; r < MR; r++) {
          const int8_t* xq = xr[r]->q + b * QK + 4 * st;
          s16[r] = iv_dot16(iv_dot16(s16[r], wl, iv_x4(xq)), wh, iv_x4(xq + 16));
        }
      }
      for (int r = 0; r < MR; r++) lo[r] = iv_widen16(s16[r]);
    } else
    for (int st = 0; st < STEPS; st++) {
      const IV w = iv_load(qb + st * 64);
      if (KIND == 1) {                                          // nibbles: elements 4s.. and 16 + 4s..
        const IV wl = iv_lo(w), wh = iv_hi(w);
        for (int r = 0; r < MR; r++) {
          const int8_t* xq = xr[r]->q + b * QK + 4 * st;
          lo[r] = iv_dot(lo[r], wl, iv_x4(xq));
          hi[r] = iv_dot(hi[r], wh, iv_x4(xq + 16));
        }
      } else if (Q8_UNSIGNED_X) {                               // (x + 128) . w, less 128 w's sum (below)
        wsum = iv_dot(wsum, ones, w);
        for (int r = 0; r < MR; r++) lo[r] = iv_dot(lo[r], iv_x4(reinterpret_cast<const int8_t*>(xr[r]->u) +
                                                                 b * QK + 4 * st), w);
      } else {                                                  // elements 4s..: even steps into lo, odd into hi
        const SignedW sw = iv_signed(w);
        for (int r = 0; r < MR; r++) {
          IV& a = (st & 1) ? hi[r] : lo[r];
          a = iv_dot_signed(a, sw, iv_x4(xr[r]->q + b * QK + 4 * st));
        }
      }
    }
    if (KIND != 1 && Q8_UNSIGNED_X) {
      const IV corr = iv_shl7(wsum);
      for (int r = 0; r < MR; r++) lo[r] = iv_sub(lo[r], corr);
    }
    const Vec dv = vload_half(d + b * IGROUP + off);
    for (int r = 0; r < MR; r++)
      acc[r] = vfma(vcvt(iv_add(lo[r], hi[r])), vmul(dv, vset1(xr[r]->d[b])), acc[r]);
    if (KIND == 1) {
      const Vec mv = vload_half(m + b * IGROUP + off);
      for (int r = 0; r < MR; r++) macc[r] = vfma(mv, vset1(xr[r]->s[b]), macc[r]);
    }
  }
  for (int r = 0; r < MR; r++) vstore(out + r * ldo, KIND == 1 ? vadd(acc[r], macc[r]) : acc[r]);
}

template <int KIND>
void block_gemm_q8_t(const float* x, int64_t M, int64_t K, const void* qs, const uint16_t* d, const uint16_t* m,
                     const float* bias, float* y, int64_t N) {
  const int64_t nb = K / QK, groups = (N + IGROUP - 1) / IGROUP;
  constexpr int64_t gbytes_per_block = (KIND == 1 ? 4 : 8) * 64;
  static thread_local QRows buffers;
  const QRow* rows = buffers.quantize(x, M, K, KIND == 2 && Q8_UNSIGNED_X);
  parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    alignas(64) float out[IQ_ROWS * IGROUP];
    const QRow* xr[IQ_ROWS];
    for (int64_t g = g0; g < g1; g++) {
      const uint8_t* q = static_cast<const uint8_t*>(qs) + g * nb * gbytes_per_block;
      const uint16_t* dg = d + g * nb * IGROUP;
      const uint16_t* mg = KIND == 1 ? m + g * nb * IGROUP : nullptr;
      const int64_t n0 = g * IGROUP, nn = std::min<int64_t>(IGROUP, N - n0);
      for (int64_t r0 = 0; r0 < M; r0 += IQ_ROWS) {         // the group's weights stay in L1 for every row tile
        const int64_t rows_here = std::min<int64_t>(IQ_ROWS, M - r0);
        for (int64_t r = 0; r < rows_here; r++) xr[r] = &rows[r0 + r];
        for (int half = 0; half < IGROUP / IV_ROWS; half++) {
          float* o = out + half * IV_ROWS;
          switch (rows_here) {
            case 1: q8_group_tile<KIND, 1>(q, dg, mg, xr, nb, half, o, IGROUP); break;
            case 2: q8_group_tile<KIND, 2>(q, dg, mg, xr, nb, half, o, IGROUP); break;
#ifdef SPECBUILD_AVX512
            case 3: q8_group_tile<KIND, 3>(q, dg, mg, xr, nb, half, o, IGROUP); break;
            case 4: q8_group_tile<KIND, 4>(q, dg, mg, xr, nb, half, o, IGROUP); break;
#endif
            default: break;
          }
        }
        for (int64_t r = 0; r < rows_here; r++)
          for (int64_t j = 0; j < nn; j++) y[(r0 + r) * N + n0 + j] = out[r * IGROUP + j] + (bias ? bias[n0 + j] : 0.f);
      }
    }
  });
}

// kind 1 = Q4_1, 2 = Q8_0 weights, interleaved by 16 rows (blocks.interleave_blocks); x rows quantized here
void block_gemm_q8(int kind, const float* x, int64_t M, int64_t K, const void* qs, const uint16_t* d,
                   const uint16_t* m, const float* bias, float* y, int64_t N) {
  if (kind == 1) block_gemm_q8_t<1>(x, M, K, qs, d, m, bias, y, N);
  else block_gemm_q8_t<2>(x, M, K, qs, d, m, bias, y, N);
}

// ---- a greedy draft's lm_head: screened on Q4_1, decided on its own Q8_0 --------------------------------------
// A greedy draft needs only the argmax of its Q8_0 lm_head's logits, which streams 49152 x 576 x 34 / 32 bytes
// (30 MB) a step. A Q4_1 copy of the same head (18 MB: blocks.quantize_blocks of the Q8_0 weights) gives every
// token's logit roughly; its SCREEN_CANDIDATES best per row are then scored by the Q8_0 kernel itself (their
// blocks gathered into one interleaved group: each lane's arithmetic is the full head's, so each candidate's logit
// is bitwise the one the full head gives it), and the row's token is the best of them, the lowest id among equals.
// That is the full head's argmax whenever it is among the candidates: on 187 draft steps of the bench's prompts
// (SmolLM2-135M int4 self-draft) the Q4_1 top 4 held it every time, the top 1 91 %. Where it is not, the draft
// proposes another token, which verify rejects: the output never depends on it. A row with a NaN logit, or fewer
// finite candidates than one, is decided on the full Q8_0 head.
constexpr int SCREEN_CANDIDATES = 8;

// the indices of the (at most) T largest values of v[0..n), by value descending then index ascending; -> how many
// (values equal to the T-th may be left out; -inf and NaN never enter), and whether v holds a NaN
inline int top_candidates(const float* v, int64_t n, int T, int32_t* idx, float* val, bool* nan) {
  int cnt = 0;
  float thr = -INFINITY;
  auto insert = [&](int64_t j) {
    const float x = v[j];
    if (!(x > thr) && cnt == T) return;
    if (!(x > -INFINITY)) return;
    int at = cnt < T ? cnt++ : T - 1;
    while (at > 0 && val[at - 1] < x) { val[at] = val[at - 1]; idx[at] = idx[at - 1]; at--; }
    val[at] = x; idx[at] = static_cast<int32_t>(j);
    if (cnt == T) thr = val[T - 1];
  };
  __m256 nan_any = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(v + j);
    nan_any = _mm256_or_ps(nan_any, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    int hits = _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(thr), _CMP_GT_OQ));
    while (hits) {
      const int l = __builtin_ctz(hits);
      hits &= hits - 1;
      insert(j + l);
    }
  }
  for (; j < n; j++) {
    if (std::isnan(v[j])) nan_any = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    else insert(j);
  }
  *nan = _mm256_movemask_ps(nan_any) != 0;
  return cnt;
}

// ---- fp32 linears on the fused step's own tiled kernel -----------------------------------------------------
// y[M, N] = x[M, K] @ W^T for an fp32 W [N, K] held in panels of 16 outputs: P [ceil(N / 16), K, 16] (W's rows
// n0..n0+15 interleaved by k, zero rows past N; `pack_panels`), so one 64-byte load at k is 16 outputs' weights.
// Outer-product tiles: for each k, a vector of weights times one broadcast x value per row, into one accumulator
// per (row, output). So every output is ONE scalar chain, y = fma(x[K-1], w[K-1], ... fma(x[0], w[0], 0)), with k
// in order, whatever the tile, the number of rows, the vector width or the thread that computes it: rows are
// batch-invariant at any row count, and an AVX2 build gives bitwise the AVX-512 build's outputs (tested).
// Tiles: MR rows x NV panels; AVX-512 (32 registers) 1-6 x 4 panels, 7-8 x 3 and 9-12 x 2 (up to 24
// accumulators), AVX2 (16 registers, a panel is 2 vectors) 1 x 4, 2-3 x 2, and 4-12 x 2 as groups of up to 3
// rows in turn (group_tile). Threads split the panels. Up to SINGLE_TILE_ROWS = 12 rows (a decode step
// of 8 sequences, a batch-1 verify of K 11, 2 sequences' of K 5, 4 sequences' of K 2) are one row tile, which walks
// its thread's whole share once: every weight is streamed from memory once, into all the rows. More rows walk
// the share in chunks of 4 panels (147-393 KB of weights at K 576-1536): the chunk's first row tile is a
// SINGLE_TILE_ROWS one, which streams it from memory into as many rows as it can hold (compute under the memory
// stream), then 6-row tiles read it from L2: a weight is read from memory once per call at any row count.
// A 12-row first tile instead of a 6-row one (the layers' linears of a 30-layer 576-wide model, Intel Xeon, 2
// threads, medians of 7-9 interleaved, two orders): 16 rows 22.2 -> 20.3-21.0 ms, 24 rows 27.9 -> 26.1, 36 rows
// 35.9 -> 33.3-34.5, 150 rows 112.2 -> 109.0 (bench/README.md, "2026-12-06 midday").
// 8 rows as one 8 x 3 tile instead of a 6 x 4 and a 2 x 4 one (which re-read each chunk from cache): the layers'
// linears of a 30-layer 576-wide model 19.96 -> 17.29 ms at 8 rows, 19.50 -> 16.92 at 7, on an Intel Xeon with
// AVX-512 (2 threads, 30 distinct weights streamed, median of 9 interleaved; bench/README.md, "2026-12-06").
// 9-12 rows as one x 2 tile instead of 6 + 3-6 rows: the same 18.36 -> 17.27 ms at 9 rows, 18.81 -> 17.57 at 10,
// 19.80 -> 17.97 at 12 (16 rows and more: no change as 8 + 8; bench/README.md, "2026-12-06 morning").
// Against the dot-product kernel this replaced (4 x 12 weight rows, one 8-lane chain per output + a horizontal
// sum) and oneDNN, AMD EPYC Zen 4 (AVX-512), 2 threads, 30 distinct weights streamed, µs per call, median of 7
// interleaved: 0.77-0.93x the old kernel's time at 1 row, 0.58-0.85x at 2, 0.61-0.72x at 36 (the lm_head at 36
// rows 174 GFLOPS; bench/README.md, "2026-12-04 afternoon").
constexpr int64_t PANEL = 16;            // outputs per panel
constexpr int64_t PANEL_CHUNK = 4;       // panels a thread walks at once
// A tile of 2+ rows prefetches its panels' weights PANEL_PREFETCH k (2 KB) ahead into L1: with more fmas per
// weight line the hardware prefetcher alone let the stream stall (the layers' linears of a 30-layer 576-wide model,
// Intel Xeon, 2 threads, median of 9 interleaved: 4 rows 17.15 -> 14.40 ms, 8 rows 19.07 -> 15.17, 16 rows
// 25.41 -> 22.06, 36 rows 37.90 -> 33.44; the target's step at 8 rows 29.2 -> 26.6). One row is left to the
// hardware: there the prefetches cost more issue slots than they saved (the step 19.69 -> 19.96 ms).
constexpr int64_t PANEL_PREFETCH = 32;

constexpr int PV_PER_PANEL = PANEL / VW;  // vectors a panel's 16 weights at one k take (AVX-512: 1, AVX2: 2)
#ifdef SPECBUILD_AVX512
template <int MR> constexpr int panels_per_tile() { return MR <= 6 ? 4 : MR <= 8 ? 3 : 2; }
constexpr int SINGLE_TILE_ROWS = 12;
#else
template <int MR> constexpr int panels_per_tile() { return MR == 1 ? 4 : 2; }   // 4+ rows: group_tile
constexpr int SINGLE_TILE_ROWS = 12;
#endif
constexpr int TILE_ROWS = 6;

// One k of G rows x NV panels: the panels' 16 weights at k times each row's x[k], into acc. PREFETCH: each
// panel's line PANEL_PREFETCH k ahead (one 64-byte line a k).
template <int G, int NV, bool PREFETCH>
inline void panel_k(Vec (&acc)[G][NV * PV_PER_PANEL], const float* x, int64_t K, const float* P, int64_t pstride,
                    int64_t k) {
  constexpr int NA = NV * PV_PER_PANEL;
  if (PREFETCH)
    for (int j = 0; j < NV; j++)
      _mm_prefetch(reinterpret_cast<const char*>(P + j * pstride + (k + PANEL_PREFETCH) * PANEL), _MM_HINT_T0);
  Vec w[NA];
  for (int j = 0; j < NV; j++)
    for (int v = 0; v < PV_PER_PANEL; v++) w[j * PV_PER_PANEL + v] = vload(P + j * pstride + k * PANEL + v * VW);
  for (int r = 0; r < G; r++) {
    const Vec xb = vset1(x[r * K + k]);
    for (int j = 0; j < NA; j++) acc[r][j] = vfma(xb, w[j], acc[r][j]);
  }
}

// MR rows of x against NV panels (their first `ncols` outputs stored; a last panel past N is zero-padded)
template <int MR, int NV>
inline void panel_tile(const float* x, int64_t K, const float* P, int64_t pstride, float* y, int64_t ldy,
                       int64_t ncols) {
  constexpr int NA = NV * PV_PER_PANEL;
  Vec acc[MR][NA];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NA; j++) acc[r][j] = vzero();
  for (int64_t k = 0; k < K; k++) panel_k<MR, NV, (MR >= 2)>(acc, x, K, P, pstride, k);
  for (int r = 0; r < MR; r++) {
    if (ncols == NV * PANEL) {
      for (int j = 0; j < NA; j++) vstore(y + r * ldy + j * VW, acc[r][j]);
    } else {
      alignas(64) float tmp[NV * PANEL];
      for (int j = 0; j < NA; j++) vstore(tmp + j * VW, acc[r][j]);
      for (int64_t c = 0; c < ncols; c++) y[r * ldy + c] = tmp[c];
    }
  }
}

#ifndef SPECBUILD_AVX512
// AVX2, 4-12 rows: 16 ymm registers hold the accumulators of 3 rows x 2 panels (or 6 x 1) at most, so the rows go
// in balanced groups of at most that many (4 = 2 + 2, 8 = 3 + 3 + 2, 12 = 4 x 3) that take turns over blocks of
// ROW_GROUP_KB k, each group's accumulators kept in memory while the others run (an exact store and reload: every
// output is still one fma chain with k in order). The first group streams the block's weights from memory, the
// others read them from L1: up to 12 rows take the weights from memory once. Before, 4-6 rows were one 1-panel
// tile (fmas waiting on the previous k's) and 7-12 rows a 6-row tile that streamed the weights and then a second
// one that re-read them from L2. The layers' linears of a 30-layer 576-wide model, an AVX2 build
// (SPECBUILD_FUSED_ISA=avx2) on an Intel Xeon, 2 threads, ms, one process per variant, medians: 4 rows 20.1 ->
// 16.6, 6 rows 20.9 -> 17.0, 8 rows 22.7 -> 19.0, 9 rows 23.6 -> 19.6, 12 rows 26.4 -> 23.1, 150 rows 173 -> 167
// (bench/README.md, "2026-12-06 evening"). Blocks of 32 or 128 k: no different from 64.
constexpr int64_t ROW_GROUP_KB = 64;

template <int NV> constexpr int group_max() { return NV == 2 ? 3 : 6; }
template <int MR, int NV> constexpr int n_groups() { return (MR + group_max<NV>() - 1) / group_max<NV>(); }
template <int MR, int NV> constexpr int group_rows(int g) {
  return MR / n_groups<MR, NV>() + (g < MR % n_groups<MR, NV>() ? 1 : 0);
}
template <int MR, int NV> constexpr int group_first(int g) {
  int r = 0;
  for (int i = 0; i < g; i++) r += group_rows<MR, NV>(i);
  return r;
}

// G rows x NV panels over k0..k1, the accumulators loaded from and stored back to acc_mem [G][NV * 2][8]
template <int G, int NV, bool PREFETCH>
inline void group_pass(const float* x, int64_t K, const float* P, int64_t pstride, int64_t k0, int64_t k1,
                       float* acc_mem) {
  constexpr int NA = NV * PV_PER_PANEL;
  Vec acc[G][NA];
  for (int r = 0; r < G; r++)
    for (int j = 0; j < NA; j++) acc[r][j] = vload(acc_mem + (r * NA + j) * VW);
  for (int64_t k = k0; k < k1; k++) panel_k<G, NV, PREFETCH>(acc, x, K, P, pstride, k);
  for (int r = 0; r < G; r++)
    for (int j = 0; j < NA; j++) vstore(acc_mem + (r * NA + j) * VW, acc[r][j]);
}

template <int MR, int NV, int g>
inline void group_passes(const float* x, int64_t K, const float* P, int64_t pstride, int64_t k0, int64_t k1,
                         float* acc_mem) {
  constexpr int G = group_rows<MR, NV>(g), R0 = group_first<MR, NV>(g), NA = NV * PV_PER_PANEL;
  group_pass<G, NV, g == 0>(x + R0 * K, K, P, pstride, k0, k1, acc_mem + R0 * NA * VW);
  if constexpr (g + 1 < n_groups<MR, NV>()) group_passes<MR, NV, g + 1>(x, K, P, pstride, k0, k1, acc_mem);
}

// MR rows x NV panels (their first `ncols` outputs stored) in row groups
template <int MR, int NV>
inline void group_tile(const float* x, int64_t K, const float* P, int64_t pstride, float* y, int64_t ldy,
                       int64_t ncols) {
  constexpr int NA = NV * PV_PER_PANEL;
  alignas(32) float acc_mem[MR * NA * VW] = {};
  for (int64_t k0 = 0; k0 < K; k0 += ROW_GROUP_KB)
    group_passes<MR, NV, 0>(x, K, P, pstride, k0, std::min(K, k0 + ROW_GROUP_KB), acc_mem);
  for (int r = 0; r < MR; r++)
    for (int64_t c = 0; c < ncols; c++) y[r * ldy + c] = acc_mem[r * NA * VW + c];
}
#endif

// MR rows against panels p0..p1
template <int MR>
inline void panel_rows(const float* x, int64_t K, const float* P, int64_t p0, int64_t p1, float* y, int64_t N) {
  const int64_t pstride = K * PANEL;
#ifndef SPECBUILD_AVX512
  if constexpr (MR >= 4) {
    int64_t p = p0;
    for (; p + 2 <= p1; p += 2)
      group_tile<MR, 2>(x, K, P + p * pstride, pstride, y + p * PANEL, N, std::min<int64_t>(2 * PANEL, N - p * PANEL));
    for (; p < p1; p++)
      group_tile<MR, 1>(x, K, P + p * pstride, pstride, y + p * PANEL, N, std::min<int64_t>(PANEL, N - p * PANEL));
  } else
#endif
  {
    constexpr int NV = panels_per_tile<MR>();
    int64_t p = p0;
    for (; p + NV <= p1; p += NV)
      panel_tile<MR, NV>(x, K, P + p * pstride, pstride, y + p * PANEL, N,
                         std::min<int64_t>(NV * PANEL, N - p * PANEL));
    for (; p < p1; p++)
      panel_tile<MR, 1>(x, K, P + p * pstride, pstride, y + p * PANEL, N, std::min<int64_t>(PANEL, N - p * PANEL));
  }
}

// one row tile of mr rows (1..SINGLE_TILE_ROWS) against panels p0..p1: panel_rows<mr>, from a table made from
// SINGLE_TILE_ROWS itself, so every tile size the paths above can ask for has its kernel
using RowTileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
template <int... I>
constexpr std::array<RowTileFn, sizeof...(I)> row_tile_table(std::integer_sequence<int, I...>) {
  return {&panel_rows<I + 1>...};
}
constexpr auto ROW_TILES = row_tile_table(std::make_integer_sequence<int, SINGLE_TILE_ROWS>());
static_assert(TILE_ROWS <= SINGLE_TILE_ROWS, "the chunked path's tiles need kernels too");

inline void row_tile(int64_t mr, const float* x, int64_t K, const float* P, int64_t p0, int64_t p1, float* y,
                     int64_t N) {
  ROW_TILES[mr - 1](x, K, P, p0, p1, y, N);
}

void tiled_gemm(const float* x, int64_t M, int64_t K, const float* P, const float* bias, float* y, int64_t N) {
  const int64_t npan = (N + PANEL - 1) / PANEL;
  const bool one_tile = M <= SINGLE_TILE_ROWS;             // one row tile: the thread's share in one walk
  parallel_for(0, npan, PANEL_CHUNK, [&](int64_t a, int64_t b) {
    const int64_t chunk = one_tile ? b - a : PANEL_CHUNK;
    for (int64_t c0 = a; c0 < b; c0 += chunk) {
      const int64_t c1 = std::min(b, c0 + chunk);
      for (int64_t r = 0; r < M;) {
        const int64_t mr = one_tile ? M : std::min<int64_t>(r == 0 ? SINGLE_TILE_ROWS : TILE_ROWS, M - r);
        row_tile(mr, x + r * K, K, P, c0, c1, y + r * N, N);
        r += mr;
      }
      if (bias) {
        const int64_t n0 = c0 * PANEL, n1 = std::min(N, c1 * PANEL);
        for (int64_t rr = 0; rr < M; rr++)
          for (int64_t n = n0; n < n1; n++) y[rr * N + n] += bias[n];
      }
    }
  });
}

// W [N, K] -> P [ceil(N / 16), K, 16] (zero rows past N): the layout tiled_gemm reads
torch::Tensor pack_panels(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32, "pack_panels: W must be [N, K] float32");
  const int64_t N = w.size(0), K = w.size(1), npan = (N + PANEL - 1) / PANEL;
  auto padded = torch::zeros({npan * PANEL, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({npan, PANEL, K}).transpose(1, 2).contiguous();
}

inline void check_panels(const torch::Tensor& P, int64_t N, int64_t K) {
  TORCH_CHECK(P.defined() && P.dim() == 3 && P.size(0) == (N + PANEL - 1) / PANEL && P.size(1) == K &&
              P.size(2) == PANEL && P.is_contiguous() && P.scalar_type() == torch::kFloat32 &&
              reinterpret_cast<uintptr_t>(P.data_ptr()) % 64 == 0,
              "tiled fp32 linear needs its weight as pack_panels(W): [ceil(N / 16), K, 16] fp32, 64-byte aligned");
}

torch::Tensor tiled_linear_t(const torch::Tensor& x, const torch::Tensor& P, const torch::Tensor& bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  tiled_gemm(x.data_ptr<float>(), M, K, P.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
             y.data_ptr<float>(), N);
  return y;
}

// ---- the bf16 prefill (EngineConfig.prefill_precision "bf16") ---------------------------------------------------
// A prompt's rows through a layer's linears on AVX-512 BF16's dot product (vdpbf16ps): x and W rounded to bf16 (to
// nearest even), the products summed in fp32. W's bf16 copy is panelled as the fp32 kernel's, a k pair at a time:
// [ceil(N / 16), K / 2, 16, 2], so one 64-byte line holds 16 outputs' weights at k and k + 1. Every output is one
// chain over the k pairs in order, whatever the tile, the rows beside it or the thread: a prompt's rows get the same
// bits in any chunk (the engine's invariant; a prefill's rows and a decode step's are never mixed in one call, and
// only prefill rows come here). Twice the fp32 FMA's work per instruction: a layer's linears at 256 rows 1.5-1.8x
// faster on an AMD EPYC Zen 4 (bench/README.md).
constexpr const char* NO_BF16_PREFILL =
    "the bf16 prefill needs AVX-512 BF16 (vdpbf16ps), which this build of the extension lacks";
#if defined(SPECBUILD_AVX512) && defined(__AVX512BF16__)
constexpr bool HAS_BF16_PREFILL = true;
constexpr int BF16_ROWS = 6;          // a tile: up to 6 rows x 4 panels (24 accumulators, 4 weight vectors)
constexpr int64_t BF16_PANELS = 4;
constexpr int64_t BF16_BLOCK_ROWS = 48;   // rows a thread takes through its panels at once

template <int MR, int NP>
inline void bf16_tile(const uint32_t* xb, int64_t K2, const uint32_t* P, int64_t p, float* y, int64_t N) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < NP; j++) acc[r][j] = _mm512_setzero_ps();
  const uint32_t* pp = P + p * K2 * PANEL;
  for (int64_t k = 0; k < K2; k++) {
    __m512bh w[NP];
    for (int j = 0; j < NP; j++) w[j] = (__m512bh)_mm512_load_si512(pp + (j * K2 + k) * PANEL);
    for (int r = 0; r < MR; r++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * K2 + k]));
      for (int j = 0; j < NP; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, w[j]);
    }
  }
  for (int j = 0; j < NP; j++) {
    const int64_t n0 = (p + j) * PANEL;
    const __mmask16 keep = n0 + PANEL <= N ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (N - n0)) - 1);
    for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * N + n0, keep, acc[r][j]);
  }
}

template <int NP>
inline void bf16_rows(int64_t mr, const uint32_t* xb, int64_t K2, const uint32_t* P, int64_t p, float* y, int64_t N) {
  switch (mr) {
    case 1: bf16_tile<1, NP>(xb, K2, P, p, y, N); break;
    case 2: bf16_tile<2, NP>(xb, K2, P, p, y, N); break;
    case 3: bf16_tile<3, NP>(xb, K2, P, p, y, N); break;
    case 4: bf16_tile<4, NP>(xb, K2, P, p, y, N); break;
    case 5: bf16_tile<5, NP>(xb, K2, P, p, y, N); break;
    default: bf16_tile<6, NP>(xb, K2, P, p, y, N); break;
  }
}

// y [M, N] = x [M, K] W^T (+ bias), x as bf16 pairs xb [M, K / 2], W as pack_panels_bf16(W)
void bf16_gemm(const uint32_t* xb, int64_t M, int64_t K2, const uint32_t* P, const float* bias, float* y, int64_t N) {
  const int64_t npan = (N + PANEL - 1) / PANEL;
  parallel_for(0, npan, BF16_PANELS, [&](int64_t a, int64_t b) {
    for (int64_t r0 = 0; r0 < M; r0 += BF16_BLOCK_ROWS) {     // a block of rows (in L1 / L2) against the
      const int64_t r1 = std::min(M, r0 + BF16_BLOCK_ROWS);    // thread's panels, 4 at a time
      for (int64_t p = a; p < b;) {
        const int64_t np = std::min<int64_t>(BF16_PANELS, b - p);      // the thread's last 1-3 panels as one tile
        for (int64_t r = r0; r < r1; r += BF16_ROWS) {
          const int64_t mr = std::min<int64_t>(BF16_ROWS, r1 - r);
          const uint32_t* xr = xb + r * K2;
          float* yr = y + r * N;
          switch (np) {
            case 4: bf16_rows<4>(mr, xr, K2, P, p, yr, N); break;
            case 3: bf16_rows<3>(mr, xr, K2, P, p, yr, N); break;
            case 2: bf16_rows<2>(mr, xr, K2, P, p, yr, N); break;
            default: bf16_rows<1>(mr, xr, K2, P, p, yr, N); break;
          }
        }
        p += np;
      }
    }
    if (bias)
      for (int64_t rr = 0; rr < M; rr++)
        for (int64_t n = a * PANEL; n < std::min(N, b * PANEL); n++) y[rr * N + n] += bias[n];
  });
}
#else
constexpr bool HAS_BF16_PREFILL = false;
void bf16_gemm(const uint32_t*, int64_t, int64_t, const uint32_t*, const float*, float*, int64_t) {
  TORCH_CHECK(false, NO_BF16_PREFILL);
}
#endif

// W [N, K] -> [ceil(N / 16), K / 2, 16, 2] bf16 (rounded to nearest even; zero rows past N): bf16_gemm's panels
torch::Tensor pack_panels_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.size(1) % 2 == 0,
              "pack_panels_bf16: W must be [N, K] float32 with K even");
  const int64_t N = w.size(0), K = w.size(1), npan = (N + PANEL - 1) / PANEL;
  auto padded = torch::zeros({npan * PANEL, K}, w.options().dtype(torch::kBFloat16));
  padded.narrow(0, 0, N).copy_(w.to(torch::kBFloat16));
  return padded.view({npan, PANEL, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

inline void check_panels_bf16(const torch::Tensor& P, int64_t N, int64_t K) {
  TORCH_CHECK(P.defined() && P.dim() == 4 && P.size(0) == (N + PANEL - 1) / PANEL && P.size(1) * 2 == K &&
              P.size(2) == PANEL && P.size(3) == 2 && P.is_contiguous() && P.scalar_type() == torch::kBFloat16 &&
              reinterpret_cast<uintptr_t>(P.data_ptr()) % 64 == 0,
              "bf16 prefill linear needs its weight as pack_panels_bf16(W): [ceil(N / 16), K / 2, 16, 2] bf16, "
              "64-byte aligned");
}

torch::Tensor bf16_linear_t(const torch::Tensor& x, const torch::Tensor& P, const torch::Tensor& bias, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  auto xb = x.to(torch::kBFloat16).contiguous();            // each element rounded to nearest even, alone
  auto y = torch::empty({M, N}, x.options());
  bf16_gemm(reinterpret_cast<const uint32_t*>(xb.data_ptr()), M, K / 2,
            reinterpret_cast<const uint32_t*>(P.data_ptr()), bias.defined() ? bias.data_ptr<float>() : nullptr,
            y.data_ptr<float>(), N);
  return y;
}

// ---- one linear layer of any kind the engine holds --------------------------------------------------------
enum Kind { PACKED_FP32 = 0, Q4_1 = 1, Q8_0 = 2, DENSE = 3, INT8_ROWWISE = 4, TILED_FP32 = 5, Q4_1_Q8 = 6, Q8_0_Q8 = 7 };

inline bool is_block(int64_t kind) { return kind == Q4_1 || kind == Q8_0 || kind == Q4_1_Q8 || kind == Q8_0_Q8; }

// y [M, N] for a block kind: fp32 activations (block_gemm) or int8 ones (block_gemm_q8); m: Q4_1's, else unused
void block_gemm_kind(int64_t kind, const float* x, int64_t M, int64_t K, const void* qs, const void* d,
                     const void* m, const float* bias, float* y, int64_t N) {
  const int scheme = (kind == Q4_1 || kind == Q4_1_Q8) ? 1 : 2;
  const void* mm = scheme == 1 ? m : nullptr;
  if (kind == Q4_1_Q8 || kind == Q8_0_Q8)
    block_gemm_q8(scheme, x, M, K, qs, static_cast<const uint16_t*>(d), static_cast<const uint16_t*>(mm), bias, y, N);
  else block_gemm(scheme, x, M, K, qs, static_cast<const float*>(d), static_cast<const float*>(mm), bias, y, N);
}

// oneDNN keeps one primitive per input shape it has seen (two caches of 1024 entries, ~0.5 MB each): ragged
// batches would show it a new row count at every other step and grow the process for hours. So a oneDNN linear
// only ever sees a bounded set of row counts: 1..16 as they are, then 24, 32, 48, 64, 96, 128, 192, 256 (the
// rows padded with zeros; a row's result does not depend on the others), and more rows in chunks of 256.
inline int64_t row_bucket(int64_t m) {
  if (m <= 16) return m;
  for (int64_t b : {24, 32, 48, 64, 96, 128, 192, 256})
    if (m <= b) return b;
  return 256;
}

torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  auto call = [&](const torch::Tensor& in) {
    torch::jit::Stack st;
    st.emplace_back(in);
    st.emplace_back(w);
    st.emplace_back(bias.defined() ? c10::IValue(bias) : c10::IValue());
    st.emplace_back(std::string("none"));
    st.emplace_back(c10::List<std::optional<at::Scalar>>());
    st.emplace_back(std::string(""));
    op.callBoxed(&st);
    return st[0].toTensor();
  };
  const int64_t M = x.size(0);
  if (M > 256) {
    std::vector<torch::Tensor> parts;
    for (int64_t r = 0; r < M; r += 256) parts.push_back(onednn_linear(x.narrow(0, r, std::min<int64_t>(256, M - r)),
                                                                       w, bias));
    return torch::cat(parts, 0);
  }
  const int64_t B = row_bucket(M);
  if (B == M) return call(x);
  auto padded = torch::zeros({B, x.size(1)}, x.options());
  padded.narrow(0, 0, M).copy_(x);
  return call(padded).narrow(0, 0, M);
}

struct Linear {
  int64_t kind = DENSE;
  torch::Tensor w, qs, d, m, bias, prefill;      // prefill: an fp32 oneDNN copy for many rows (int8), or undefined
  torch::Tensor prefill_bf16;                     // pack_panels_bf16(W) for a prompt's rows (with_bf16_prefill), or undefined
  int64_t prefill_min_rows = 1 << 30;
  int64_t N = 0, K = 0;

  // x [M, K] float32 contiguous -> [M, N]; prompt: the rows are a prompt's (Runner::forward's `prefill`)
  torch::Tensor operator()(const torch::Tensor& x, bool prompt = false) const {
    const int64_t M = x.size(0);
    if (prompt && prefill_bf16.defined()) return bf16_linear_t(x, prefill_bf16, bias, N);
    if (kind == TILED_FP32) return tiled_linear_t(x, w, bias, N);
    if (kind == PACKED_FP32 || (prefill.defined() && M >= prefill_min_rows))
      return onednn_linear(x, kind == PACKED_FP32 ? w : prefill, bias);
    if (is_block(kind)) {
      auto y = torch::empty({M, N}, x.options());
      block_gemm_kind(kind, x.data_ptr<float>(), M, K, qs.data_ptr(), d.data_ptr(),
                      m.defined() ? m.data_ptr() : nullptr, bias.defined() ? bias.data_ptr<float>() : nullptr,
                      y.data_ptr<float>(), N);
      return y;
    }
    if (kind == INT8_ROWWISE) {                     // torch's int8 weight-only kernel, bf16 activations
      auto y = at::_weight_int8pack_mm(x.to(torch::kBFloat16), w, d).to(torch::kFloat32);
      return bias.defined() ? y + bias : y;
    }
    return at::linear(x, w, bias.defined() ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
  }
};

// The blocks a block kind reads, in its layout: Q4_1 / Q8_0 as stored (qs [N, nb, 16 | 32], d and m [N, nb]);
// Q4_1_Q8 / Q8_0_Q8 interleaved by 16 rows (qs [G, nb, 4 | 8, 16, 4], d and m fp16 [G, nb, 16]). A tensor of the other
// layout holds other byte counts when N % 16 != 0: read as this one, the kernel would run past its end.
inline void check_blocks(int64_t kind, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m,
                         int64_t N, int64_t K) {
  const bool q41 = kind == Q4_1 || kind == Q4_1_Q8, inter = kind == Q4_1_Q8 || kind == Q8_0_Q8;
  const int64_t nb = K / QK, G = (N + IGROUP - 1) / IGROUP;
  const std::vector<int64_t> qshape = inter ? std::vector<int64_t>{G, nb, q41 ? 4 : 8, IGROUP, 4}
                                            : std::vector<int64_t>{N, nb, q41 ? 16 : 32};
  const std::vector<int64_t> dshape = inter ? std::vector<int64_t>{G, nb, IGROUP} : std::vector<int64_t>{N, nb};
  auto is = [](const torch::Tensor& t, const std::vector<int64_t>& shape, c10::ScalarType type) {
    return t.defined() && t.sizes().vec() == shape && t.is_contiguous() && t.scalar_type() == type;
  };
  const auto stype = inter ? torch::kHalf : torch::kFloat32;
  TORCH_CHECK(is(qs, qshape, q41 ? torch::kUInt8 : torch::kInt8) && is(d, dshape, stype) &&
              (q41 ? is(m, dshape, stype) : !(m.defined() && m.numel())),
              "block linear of kind ", kind, ": qs / d / m are not in its layout for ", N, " x ", K, " (",
              inter ? "interleaved by 16 rows: blocks.interleave_blocks" : "as stored", ")");
}

Linear make_linear(int64_t kind, torch::Tensor w, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                   torch::Tensor bias, torch::Tensor prefill, int64_t prefill_min_rows, int64_t N, int64_t K) {
  auto opt = [](torch::Tensor t) { return t.defined() && t.numel() > 0 ? t : torch::Tensor(); };  // empty = none
  Linear l;
  l.kind = kind; l.w = opt(w); l.qs = opt(qs); l.d = opt(d); l.m = opt(m); l.bias = opt(bias); l.prefill = opt(prefill);
  l.prefill_min_rows = prefill_min_rows; l.N = N; l.K = K;
  TORCH_CHECK(!is_block(kind) || K % QK == 0, "block-quantized linear needs in_features % 32 == 0");
  if (is_block(kind)) check_blocks(kind, l.qs, l.d, l.m, N, K);
  if (kind == TILED_FP32) check_panels(l.w, N, K);
  return l;
}

// the same Linear with a bf16 copy of its weight for a prompt's rows (EngineConfig.prefill_precision "bf16")
Linear with_bf16_prefill(Linear l, torch::Tensor panels) {
  TORCH_CHECK(HAS_BF16_PREFILL, NO_BF16_PREFILL);
  check_panels_bf16(panels, l.N, l.K);
  l.prefill_bf16 = panels;
  return l;
}

// n floats from p into L2, a 64-byte line at a time (n <= 0: nothing; prefetches never fault): the next block of K
// or V rows while a segment's queries use this one. The int4 draft step at 8 rows / context 200 against the kernel
// before segments: 0.92x the time with this, 0.95x with no prefetch, 1.04x prefetching into L1 (AMD EPYC Zen 4, 5
// interleaved); at 1 row / context 300 0.95x and 0.96x (15; bench/README.md "2026-12-07 late")
inline void prefetch_rows(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}

// o[0 .. 8 NV) += sum_p sc[p] * v[p * ld + ..]: each element summed over p in order (on from what o holds), NV
// independent chains
template <int NV>
inline void add_values(const float* sc, int64_t n, const float* v, int64_t ld, float* o) {
  __m256 acc[NV];
  for (int j = 0; j < NV; j++) acc[j] = _mm256_loadu_ps(o + 8 * j);
  for (int64_t p = 0; p < n; p++) {
    const __m256 sp = _mm256_set1_ps(sc[p]);
    for (int j = 0; j < NV; j++) acc[j] = _mm256_fmadd_ps(sp, _mm256_loadu_ps(v + p * ld + 8 * j), acc[j]);
  }
  for (int j = 0; j < NV; j++) _mm256_storeu_ps(o + 8 * j, acc[j]);
}

inline void rms_norm_rows(const float* x, const float* w, float* out, int64_t N, int64_t H, double eps) {
  for (int64_t r = 0; r < N; r++) {
    const float* xr = x + r * H;
    float ss = dot8(xr, xr, H);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    float* o = out + r * H;
    for (int64_t i = 0; i < H; i++) o[i] = w[i] * (xr[i] * inv);
  }
}

struct Layer {
  torch::Tensor in_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

// Attention's split: queries (row, head) over the threads once a step scores more than ATT_SERIAL_WORK
// (positions x heads; the pool's workers spin, so a fork costs ~1 us, ~60 positions' scores). At 2048 a 1-row
// step at context 200 (1809) ran its 30 layers' attention on one thread: an int4 draft step 6.94 -> 6.29 ms on an
// Intel Xeon (2 threads) with 256. The queries that read one K/V run as a segment (`Runner::segment`), ATT_BLOCK
// positions at a time: one query at a time, with the kv group's first head prefetching 32 positions ahead into
// L2, a verify of 4 sequences x 9 rows at context 600 took 1.10-1.14x as long (the target's step; AMD EPYC Zen 4,
// bench/README.md "2026-12-07 late").
constexpr int64_t ATT_SERIAL_WORK = 256;
constexpr int64_t ATT_BLOCK = 32;         // positions of K or V a segment's queries share from L1 (8 KB at hd 64)
constexpr int64_t ATT_SEGMENT = 32;       // queries at most in one segment (their scores: 32 x context floats)

class Runner {
 public:
  Runner(int64_t hidden, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t inter, double eps,
         torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kc, std::vector<torch::Tensor> vc)
      : H(hidden), nh(n_heads), nkv(n_kv), hd(head_dim), inter(inter), eps(eps), cos(cos), sin(sin), kc(kc), vc(vc) {
    TORCH_CHECK(hd % 16 == 0 && H % 8 == 0 && inter % 8 == 0, "fused runner: sizes must be multiples of 8");
  }

  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, Linear qkv, Linear o, Linear gate_up,
                 Linear down) {
    layers.push_back(Layer{in_norm, post_norm, qkv, o, gate_up, down});
  }

  // x [N, H] float32 (the embedded tokens, or the hidden states after layer `first` - 1), slots/pos [N] int64 ->
  // hidden states [N, H] after layers [first, last) (last -1: every layer to the end). A forward run in pieces
  // gives the same bits as one run whole: each row's arithmetic is its own (the scheduler runs another request's
  // prefill between the pieces of a verify, model.py `ragged_forward(between=...)`).
  // prefill: the rows are prompts' (a linear with a bf16 prefill copy computes them on it; no other row may be in
  // such a call).
  torch::Tensor forward(torch::Tensor x, torch::Tensor slots, torch::Tensor pos, int64_t first, int64_t last,
                        bool prefill) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H && x.scalar_type() == torch::kFloat32, "x must be [N, hidden] fp32");
    TORCH_CHECK(static_cast<int64_t>(layers.size()) == static_cast<int64_t>(kc.size()), "runner: layers != cache");
    const int64_t nl = static_cast<int64_t>(layers.size());
    if (last < 0) last = nl;
    TORCH_CHECK(0 <= first && first <= last && last <= nl, "runner: layer range [", first, ", ", last,
                ") outside [0, ", nl, "]");
    py::gil_scoped_release nogil;
    x = x.contiguous().clone();
    const int64_t N = x.size(0);
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t* ps = pos.data_ptr<int64_t>();
    const int64_t S = kc[0].size(2);
    for (int64_t r = 0; r < N; r++)
      TORCH_CHECK(ps[r] >= 0 && ps[r] < S && ps[r] < cos.size(0) && sl[r] >= 0 && sl[r] < kc[0].size(0),
                  "fused runner: position or slot out of range");
    auto h = torch::empty({N, H}, x.options());
    auto att = torch::empty({N, nh * hd}, x.options());
    for (int64_t li = first; li < last; li++) {
      const Layer& L = layers[li];
      float* xp = x.data_ptr<float>();
      float* hp = h.data_ptr<float>();
      norm_rows(xp, L.in_norm, hp, N);
      auto qkv = L.qkv(h, prefill).contiguous();                 // [N, (nh + 2 nkv) * hd]
      rows(N, [&](int64_t a, int64_t b) { rope_and_write(qkv, sl, ps, a, b, kc[li], vc[li]); });
      attention(qkv, sl, ps, N, kc[li], vc[li], att);
      add_into(xp, L.o(att, prefill).contiguous(), N, H);
      norm_rows(xp, L.post_norm, hp, N);
      auto gu = L.gate_up(h, prefill).contiguous();              // [N, 2 inter]: gate | up
      auto a = torch::empty({N, inter}, x.options());
      rows(N, [&](int64_t r0, int64_t r1) { silu_mul(gu.data_ptr<float>(), a.data_ptr<float>(), r0, r1); });
      add_into(xp, L.down(a, prefill).contiguous(), N, H);
    }
    return x;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

 private:
  int64_t H, nh, nkv, hd, inter;
  double eps;
  torch::Tensor cos, sin;                 // [max_pos, hd]; sin sign-folded: rotate_half(x) * sin == roll(x) * sin'
  std::vector<torch::Tensor> kc, vc;      // per layer [slots + 1, nkv, S, hd]
  std::vector<Layer> layers;

  // The per-row work between the linears (norms, RoPE and the cache writes, SiLU, the residual adds) over the
  // threads once a forward has ROWS_GRAIN rows or more (a prefill's; a decode step's few rows stay on this thread):
  // each row's arithmetic is its own either way. A 256-row prefill ran 5 % of its time here on one thread (perf,
  // AMD EPYC Zen 4).
  static constexpr int64_t ROWS_GRAIN = 32;
  template <class F>
  static void rows(int64_t N, const F& f) { parallel_for(0, N, ROWS_GRAIN, f); }

  void norm_rows(const float* x, const torch::Tensor& w, float* out, int64_t N) const {
    const float* wp = w.data_ptr<float>();
    rows(N, [&](int64_t a, int64_t b) { rms_norm_rows(x + a * H, wp, out + a * H, b - a, H, eps); });
  }

  static void add_into(float* x, const torch::Tensor& y, int64_t N, int64_t H) {
    const float* yp = y.data_ptr<float>();
    rows(N, [&](int64_t a, int64_t b) {
      for (int64_t i = a * H; i < b * H; i++) x[i] += yp[i];
    });
  }

  void silu_mul(const float* gu, float* out, int64_t r0, int64_t r1) const {   // silu(g) * u = g / (1 + e^-g) * u
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = r0; r < r1; r++) {
      const float* g = gu + r * 2 * inter;
      const float* u = g + inter;
      float* o = out + r * inter;
      for (int64_t i = 0; i < inter; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
      }
    }
  }

  // RoPE on the q and k heads of every row (in place: x*cos + roll(x, hd/2)*sin'), then K and V into the cache
  void rope_and_write(torch::Tensor& qkv, const int64_t* sl, const int64_t* ps, int64_t r0, int64_t r1,
                      torch::Tensor& kcache, torch::Tensor& vcache) const {
    const int64_t width = (nh + 2 * nkv) * hd, half = hd / 2, S = kcache.size(2);
    float* base = qkv.data_ptr<float>();
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    float* kp = kcache.data_ptr<float>();
    float* vp = vcache.data_ptr<float>();
    std::vector<float> tmp(hd);
    for (int64_t r = r0; r < r1; r++) {
      float* row = base + r * width;
      const float* c = cs + ps[r] * hd;
      const float* s = sn + ps[r] * hd;
      for (int64_t j = 0; j < nh + nkv; j++) {
        float* v = row + j * hd;
        std::memcpy(tmp.data(), v, hd * sizeof(float));
        for (int64_t i = 0; i < hd; i++) {
          const float rolled = i < half ? tmp[i + half] : tmp[i - half];
          v[i] = tmp[i] * c[i] + rolled * s[i];
        }
      }
      for (int64_t j = 0; j < nkv; j++) {
        const int64_t at = ((sl[r] * nkv + j) * S + ps[r]) * hd;
        std::memcpy(kp + at, row + (nh + j) * hd, hd * sizeof(float));
        std::memcpy(vp + at, row + (nh + nkv + j) * hd, hd * sizeof(float));
      }
    }
  }

  // att[r, h] = softmax(q_rh . K[slot_r, h/g, 0..pos_r] / sqrt(hd)) . V[...]  (GQA: g = nh / nkv)
  //
  // A query is a (row, head). Queries that read the same K/V (the rows of one sequence, a verify's K + 1 or a
  // prefill's, times the heads of one kv group) run as a segment: ATT_BLOCK positions of K, then of V, are loaded
  // once into L1 and every query of the segment uses them, where one query at a time streamed them from L2 once
  // per query. Each query's arithmetic is what it was alone (its scores, max, exp-sum and the V sum in position
  // order), so a row's bits do not depend on the rows beside it.
  void attention(const torch::Tensor& qkv, const int64_t* sl, const int64_t* ps, int64_t N,
                 const torch::Tensor& kcache, const torch::Tensor& vcache, torch::Tensor& att) const {
    const int64_t width = (nh + 2 * nkv) * hd, S = kcache.size(2), group = nh / nkv;
    const float* qb = qkv.data_ptr<float>();
    const float* kp = kcache.data_ptr<float>();
    const float* vp = vcache.data_ptr<float>();
    float* out = att.data_ptr<float>();
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    // queries in the order (rows of one slot, kv group, row, head): a thread's chunk then holds whole segments
    std::vector<int64_t> qrow(N * nh), qhead(N * nh);
    int64_t t = 0, work = 0;
    for (int64_t r0 = 0; r0 < N;) {
      int64_t r1 = r0 + 1;
      while (r1 < N && sl[r1] == sl[r0]) r1++;
      for (int64_t g = 0; g < nkv; g++)
        for (int64_t r = r0; r < r1; r++)
          for (int64_t h = g * group; h < (g + 1) * group; h++, t++) qrow[t] = r, qhead[t] = h;
      r0 = r1;
    }
    for (int64_t r = 0; r < N; r++) work += (ps[r] + 1) * nh;
    const int64_t grain = work > ATT_SERIAL_WORK ? 1 : N * nh;     // small steps: no thread fork/join
    parallel_for(0, N * nh, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t a = t0; a < t1;) {
        const int64_t slot = sl[qrow[a]], kvh = qhead[a] / group;
        int64_t b = a + 1;
        while (b < t1 && b - a < ATT_SEGMENT && sl[qrow[b]] == slot && qhead[b] / group == kvh) b++;
        segment(qb, width, kp + (slot * nkv + kvh) * S * hd, vp + (slot * nkv + kvh) * S * hd, scale, ps,
                qrow.data() + a, qhead.data() + a, b - a, out);
        a = b;
      }
    });
  }

  // Q queries over one K/V (kr, vr: [S, hd]): scores, softmax and the weighted V sum, a block of positions at a time
  void segment(const float* qb, int64_t width, const float* kr, const float* vr, float scale, const int64_t* ps,
               const int64_t* qrow, const int64_t* qhead, int64_t Q, float* out) const {
    int64_t nmax = 0;
    for (int64_t q = 0; q < Q; q++) nmax = std::max(nmax, ps[qrow[q]] + 1);
    const int64_t ld = (nmax + 7) / 8 * 8;                          // one query's scores, padded to 8
    static thread_local std::vector<float> sbuf, abuf, ibuf;      // grown once per thread, not per segment
    if (static_cast<int64_t>(sbuf.size()) < Q * ld) sbuf.resize(Q * ld);
    if (static_cast<int64_t>(abuf.size()) < Q * hd) abuf.resize(Q * hd);
    if (static_cast<int64_t>(ibuf.size()) < Q) ibuf.resize(Q);
    float* sc = sbuf.data();
    float* acc = abuf.data();
    float* inv = ibuf.data();
    const __m256 scale8 = _mm256_set1_ps(scale);
    // scores: 8 positions at a time (dot8x8: the same bits as one by one), the rest one by one
    for (int64_t p0 = 0; p0 < nmax; p0 += ATT_BLOCK) {
      prefetch_rows(kr + (p0 + ATT_BLOCK) * hd, std::min(ATT_BLOCK, nmax - p0 - ATT_BLOCK) * hd);
      for (int64_t q = 0; q < Q; q++) {
        const int64_t e = std::min(p0 + ATT_BLOCK, ps[qrow[q]] + 1);
        const float* qv = qb + qrow[q] * width + qhead[q] * hd;
        float* s = sc + q * ld;
        int64_t p = p0;
        for (; p + 8 <= e; p += 8) _mm256_storeu_ps(s + p, _mm256_mul_ps(dot8x8(qv, kr + p * hd, hd, hd), scale8));
        for (; p < e; p++) s[p] = dot8(qv, kr + p * hd, hd) * scale;
      }
    }
    // softmax's numerator in place (exp(s - max), 0 past the query's positions) and 1 / its sum, per query
    for (int64_t q = 0; q < Q; q++) {
      const int64_t n = ps[qrow[q]] + 1, n8 = (n + 7) / 8 * 8;
      float* s = sc + q * ld;
      float mx = -INFINITY;
      for (int64_t p = 0; p < n; p++) mx = s[p] > mx ? s[p] : mx;
      for (int64_t p = n; p < n8; p++) s[p] = -INFINITY;            // exp -> 0: the tail adds nothing
      __m256 sumv = _mm256_setzero_ps();
      const __m256 mxv = _mm256_set1_ps(mx);
      for (int64_t p = 0; p < n8; p += 8) {
        const __m256 ev = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + p), mxv));
        _mm256_storeu_ps(s + p, ev);
        sumv = _mm256_add_ps(sumv, ev);
      }
      inv[q] = 1.0f / hsum8(sumv);
      std::fill(acc + q * hd, acc + (q + 1) * hd, 0.0f);
    }
    // V: each output element sums over p in order; the hd / 8 vectors of a V row are independent chains
    for (int64_t p0 = 0; p0 < nmax; p0 += ATT_BLOCK) {
      prefetch_rows(vr + (p0 + ATT_BLOCK) * hd, std::min(ATT_BLOCK, nmax - p0 - ATT_BLOCK) * hd);
      for (int64_t q = 0; q < Q; q++) {
        const int64_t e = std::min(p0 + ATT_BLOCK, ps[qrow[q]] + 1);
        if (e <= p0) continue;
        const float* s = sc + q * ld;
        float* o = acc + q * hd;
        for (int64_t i0 = 0; i0 < hd; i0 += 64) {
          switch (std::min<int64_t>(8, (hd - i0) / 8)) {      // hd % 16 == 0: 2, 4, 6 or 8 vectors
            case 2: add_values<2>(s + p0, e - p0, vr + p0 * hd + i0, hd, o + i0); break;
            case 4: add_values<4>(s + p0, e - p0, vr + p0 * hd + i0, hd, o + i0); break;
            case 6: add_values<6>(s + p0, e - p0, vr + p0 * hd + i0, hd, o + i0); break;
            default: add_values<8>(s + p0, e - p0, vr + p0 * hd + i0, hd, o + i0); break;
          }
        }
      }
    }
    for (int64_t q = 0; q < Q; q++) {
      const __m256 iv = _mm256_set1_ps(inv[q]);
      const float* o = acc + q * hd;
      float* dst = out + qrow[q] * nh * hd + qhead[q] * hd;
      for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(o + i), iv));
    }
  }
};

torch::Tensor block_linear(int64_t kind, torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m,
                           torch::Tensor bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x must be [M, K] float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(is_block(kind), "block_linear: kind must be Q4_1 (1), Q8_0 (2), Q4_1_Q8 (6) or Q8_0_Q8 (7)");
  check_blocks(kind, qs, d, m, N, K);
  auto y = torch::empty({M, N}, x.options());
  py::gil_scoped_release nogil;
  block_gemm_kind(kind, x.data_ptr<float>(), M, K, qs.data_ptr(), d.data_ptr(),
                  m.defined() && m.numel() ? m.data_ptr() : nullptr,
                  bias.defined() && bias.numel() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>(), N);
  return y;
}

// The index of each row's largest value, as torch.argmax gives it: the first of equal maxima, and the first NaN
// where a row has one (torch ranks NaN above every number). torch's CPU argmax took 44-49 us a row of 49152 logits
// (270-400 us for a K 8 verify's 9 rows; AMD EPYC Zen 4), this loop ~4 us, and a greedy round takes one row per
// draft step and one per verified row: 4 x 8 lanes here keep each its running maximum and where it was (a strictly greater value replaces it, so
// each lane keeps its first), then the lane with the largest value, lowest index among equals, wins.
int64_t argmax_row(const float* v, int64_t n) {
  constexpr int A = 4;                          // independent lanes' chains: a blend's latency is not the bound
  int64_t i = 0, best = 0;
  float bv = n ? v[0] : 0.f;
  bool nan = false;
  if (n >= 8 * A) {
    __m256 mv[A], nan_any = _mm256_setzero_ps();
    __m256i mi[A], idx[A];
    const __m256i step = _mm256_set1_epi32(8 * A);
    for (int a = 0; a < A; a++) {
      mv[a] = _mm256_loadu_ps(v + 8 * a);
      mi[a] = idx[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * a));
      nan_any = _mm256_or_ps(nan_any, _mm256_cmp_ps(mv[a], mv[a], _CMP_UNORD_Q));
    }
    for (i = 8 * A; i + 8 * A <= n; i += 8 * A)
      for (int a = 0; a < A; a++) {
        const __m256 x = _mm256_loadu_ps(v + i + 8 * a);
        idx[a] = _mm256_add_epi32(idx[a], step);
        const __m256 gt = _mm256_cmp_ps(x, mv[a], _CMP_GT_OQ);
        nan_any = _mm256_or_ps(nan_any, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        mv[a] = _mm256_blendv_ps(mv[a], x, gt);
        mi[a] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(mi[a]), _mm256_castsi256_ps(idx[a]), gt));
      }
    alignas(32) float lv[8 * A];
    alignas(32) int32_t li[8 * A];
    for (int a = 0; a < A; a++) {
      _mm256_store_ps(lv + 8 * a, mv[a]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(li + 8 * a), mi[a]);
    }
    bv = lv[0]; best = li[0];
    for (int j = 1; j < 8 * A; j++)
      if (lv[j] > bv || (lv[j] == bv && li[j] < best)) { bv = lv[j]; best = li[j]; }
    nan = _mm256_movemask_ps(nan_any) != 0;
  }
  for (int64_t j = (n >= 8 * A ? i : 1); j < n && !nan; j++) {
    if (std::isnan(v[j])) nan = true;
    else if (v[j] > bv) { bv = v[j]; best = j; }
  }
  if (nan || std::isnan(bv))
    for (int64_t j = 0; j < n; j++)
      if (std::isnan(v[j])) return j;
  return best;
}

std::vector<int64_t> argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "argmax_rows: x must be [M, N] float32 on the CPU");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t(1) << 31), "argmax_rows: rows of 1 to 2^31 - 1 values");
  x = x.contiguous();
  std::vector<int64_t> out(x.size(0));
  const float* p = x.data_ptr<float>();
  py::gil_scoped_release nogil;
  for (int64_t r = 0; r < x.size(0); r++) out[r] = argmax_row(p + r * x.size(1), x.size(1));
  return out;
}

// x [M, K] -> each row's token (SCREEN_CANDIDATES, above): screened on the Q4_1 head (interleaved: qs4, d4, m4),
// decided on the Q8_0 one (interleaved: qs8, d8), N outputs
std::vector<int64_t> screened_argmax(torch::Tensor x, torch::Tensor qs4, torch::Tensor d4, torch::Tensor m4,
                                     torch::Tensor qs8, torch::Tensor d8, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "screened_argmax: x must be [M, K] float32 on the CPU");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && N > 0, "screened_argmax: in_features must be a multiple of 32");
  check_blocks(Q4_1_Q8, qs4, d4, m4, N, K);
  check_blocks(Q8_0_Q8, qs8, d8, torch::Tensor(), N, K);
  std::vector<int64_t> out(M);
  const float* xp = x.data_ptr<float>();
  const auto* q8 = static_cast<const uint8_t*>(qs8.data_ptr());
  const auto* dd8 = static_cast<const uint16_t*>(d8.data_ptr());
  py::gil_scoped_release nogil;
  static thread_local std::vector<float> rough, full;
  static thread_local std::vector<uint8_t> gq;
  static thread_local std::vector<uint16_t> gd;
  static thread_local QRows qrows;
  if (static_cast<int64_t>(rough.size()) < M * N) rough.resize(M * N);
  block_gemm_q8_t<1>(xp, M, K, qs4.data_ptr(), static_cast<const uint16_t*>(d4.data_ptr()),
                     static_cast<const uint16_t*>(m4.data_ptr()), nullptr, rough.data(), N);
  const QRow* rows = qrows.quantize(xp, M, K, Q8_UNSIGNED_X);  // the rows block_gemm_q8_t quantized, for Q8_0
  constexpr int64_t STEPS = 8, GB = STEPS * 64;              // Q8_0: 64-byte vectors, bytes of a group's block
  gq.assign(nb * GB, 0);
  gd.assign(nb * IGROUP, 0);
  for (int64_t r = 0; r < M; r++) {
    int32_t idx[SCREEN_CANDIDATES];
    float val[SCREEN_CANDIDATES];
    bool nan = false;
    const int cnt = top_candidates(rough.data() + r * N, N, static_cast<int>(std::min<int64_t>(SCREEN_CANDIDATES, N)),
                                   idx, val, &nan);
    if (nan || cnt == 0) {                                   // decided on the full Q8_0 head
      if (static_cast<int64_t>(full.size()) < N) full.resize(N);
      block_gemm_q8_t<2>(xp + r * K, 1, K, qs8.data_ptr(), dd8, nullptr, nullptr, full.data(), N);
      out[r] = argmax_row(full.data(), N);
      continue;
    }
    for (int c = 0; c < cnt; c++) {                          // candidate c -> lane c of one gathered group
      const int64_t v = idx[c], g = v / IGROUP, lane = v % IGROUP;
      const uint8_t* src = q8 + g * nb * GB + 4 * lane;
      for (int64_t b = 0; b < nb; b++) {
        for (int64_t st = 0; st < STEPS; st++)
          std::memcpy(gq.data() + b * GB + st * 64 + 4 * c, src + b * GB + st * 64, 4);
        gd[b * IGROUP + c] = dd8[(g * nb + b) * IGROUP + lane];
      }
    }
    alignas(64) float logit[IGROUP];
    const QRow* xr[1] = {&rows[r]};
    for (int half = 0; half * IV_ROWS < cnt; half++)
      q8_group_tile<2, 1>(gq.data(), gd.data(), nullptr, xr, nb, half, logit + half * IV_ROWS, IGROUP);
    int64_t best = -1;
    float bv = 0.f;
    for (int c = 0; c < cnt; c++) {
      const float y = logit[c] + 0.f;                        // as block_gemm_q8_t adds a missing bias
      if (best < 0 || y > bv || (y == bv && idx[c] < best)) { best = idx[c]; bv = y; }
    }
    out[r] = best;
  }
  return out;
}

// ---- the target's greedy token without reading its fp32 lm_head ---------------------------------------------
// A greedy row's token is the argmax of the fp32 head's logits y = W x (the tiled kernel: each output one fma chain
// over k). A Q8_0 copy of W on int8 x gives every logit s_r at a quarter of the bytes (113 -> 30 MB for a 49152 x
// 576 head), and s_r is provably within B_r of y_r:
//   |s_r - y_r| <= |w8_r . xq - w_r . x| + rounding <= ||w_r - w8_r|| ||x|| + ||w8_r|| ||x - xq|| + slack_r
// (Cauchy-Schwarz on (w8 - w) . x + w8 . (xq - x); w8, xq the dequantized blocks; slack_r = 2e-4 (||w_r|| ||x|| +
// ||w8_r|| ||xq||), far above the rounding of both sums: an fma chain of K = 576 terms errs by at most
// K 2^-24 sum |w x| = 3.4e-5 ||w|| ||x||). With L = max_r (s_r - B_r), every r with s_r + B_r < L has y_r < L <= the
// y of the row that attains L: the argmax (the first of equal maxima, as torch's) is among the candidates
// s_r + B_r >= L, whose y_r are computed here on the head's own panels by the tiled kernel (bitwise the full
// head's). So the token is the full head's, always; a row with more than `cap` candidates, a NaN or an infinity
// is decided on the full head. norms [3, N]: ||w_r||, ||w8_r||, ||w_r - w8_r|| (rounded up; kernels.py).
std::vector<int64_t> bounded_argmax(torch::Tensor x, torch::Tensor qs8, torch::Tensor d8, torch::Tensor norms,
                                    torch::Tensor P, int64_t N, int64_t cap, torch::Tensor counts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "bounded_argmax: x must be [M, K] float32 on the CPU");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  TORCH_CHECK(K % QK == 0 && N > 0, "bounded_argmax: in_features must be a multiple of 32");
  check_blocks(Q8_0_Q8, qs8, d8, torch::Tensor(), N, K);
  check_panels(P, N, K);
  TORCH_CHECK(norms.dim() == 2 && norms.size(0) == 3 && norms.size(1) == N && norms.is_contiguous() &&
              norms.scalar_type() == torch::kFloat32, "bounded_argmax: norms must be [3, N] float32");
  TORCH_CHECK(!counts.defined() || counts.numel() == 0 ||
              (counts.numel() == M && counts.scalar_type() == torch::kInt64 && counts.is_contiguous()),
              "bounded_argmax: counts must be empty or [M] int64");
  std::vector<int64_t> out(M);
  const float* xp = x.data_ptr<float>();
  const float* pp = P.data_ptr<float>();
  const float *nw = norms.data_ptr<float>(), *n8 = nw + N, *ne = nw + 2 * N;
  int64_t* cnt_out = counts.defined() && counts.numel() ? counts.data_ptr<int64_t>() : nullptr;
  py::gil_scoped_release nogil;
  static thread_local std::vector<float> s;
  if (static_cast<int64_t>(s.size()) < M * N) s.resize(M * N);
  float* sp = s.data();
  block_gemm_q8_t<2>(xp, M, K, qs8.data_ptr(), static_cast<const uint16_t*>(d8.data_ptr()), nullptr, nullptr, sp, N);
  parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    static thread_local std::vector<float> full;
    static thread_local std::vector<int32_t> cand;
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> xd, xs;
    if (static_cast<int64_t>(full.size()) < N + PANEL) full.resize(N + PANEL);
    xq.resize(K);
    xd.resize(nb);
    xs.resize(nb);
    for (int64_t r = r0; r < r1; r++) {
      const float* xr = xp + r * K;
      const float* sr = sp + r * N;
      quantize_row_q8(xr, K, xq.data(), xd.data(), xs.data());   // as block_gemm_q8_t quantized this row
      double X = 0, XQ = 0, DX = 0;
      for (int64_t k = 0; k < K; k++) {
        const double v = xr[k], q = static_cast<double>(xq[k]) * xd[k / QK];
        X += v * v; XQ += q * q; DX += (v - q) * (v - q);
      }
      bool ok = std::isfinite(X) && std::isfinite(XQ);
      // B_n = (ne X + n8 DX + 2e-4 (nw X + n8 XQ)) (1 + 1e-5): its own float arithmetic rounded up with it
      const float up = 1.00001f;
      const float cx = static_cast<float>(std::sqrt(X) * (1 + 1e-6)) * up;
      const float cdx = static_cast<float>(std::sqrt(DX) * (1 + 1e-6)) * up;
      const float cw = 2e-4f * cx, c8 = 2e-4f * static_cast<float>(std::sqrt(XQ) * (1 + 1e-6)) * up;
      const __m256 vx = _mm256_set1_ps(cx), vdx = _mm256_set1_ps(cdx), vw = _mm256_set1_ps(cw),
                   v8 = _mm256_set1_ps(c8);
      auto bound8 = [&](int64_t n) {
        const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ne + n), vx);
        const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(n8 + n), _mm256_add_ps(vdx, v8));
        return _mm256_add_ps(_mm256_add_ps(a, b), _mm256_mul_ps(_mm256_loadu_ps(nw + n), vw));
      };
      auto bound1 = [&](int64_t n) { return ne[n] * cx + n8[n] * (cdx + c8) + nw[n] * cw; };
      __m256 vmax = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
      const __m256 inf = _mm256_set1_ps(INFINITY);
      const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      int64_t n = 0;
      for (; n + 8 <= N; n += 8) {
        const __m256 sv = _mm256_loadu_ps(sr + n);
        vmax = _mm256_max_ps(vmax, _mm256_sub_ps(sv, bound8(n)));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_and_ps(sv, absmask), inf, _CMP_NLT_UQ));  // NaN or +-inf
      }
      alignas(32) float m8[8];
      _mm256_store_ps(m8, vmax);
      float L = -INFINITY;
      for (int j = 0; j < 8; j++) L = std::max(L, m8[j]);
      for (; n < N; n++) {
        if (!std::isfinite(sr[n])) ok = false;
        L = std::max(L, sr[n] - bound1(n));
      }
      ok = ok && _mm256_movemask_ps(bad) == 0 && std::isfinite(L);
      cand.clear();
      if (ok) {
        const __m256 vl = _mm256_set1_ps(L);
        for (n = 0; n + 8 <= N && static_cast<int64_t>(cand.size()) <= cap; n += 8) {
          int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(sr + n), bound8(n)), vl,
                                                      _CMP_GE_OQ));
          while (mask) {
            cand.push_back(static_cast<int32_t>(n + __builtin_ctz(mask)));
            mask &= mask - 1;
          }
        }
        for (; n < N && static_cast<int64_t>(cand.size()) <= cap; n++)
          if (sr[n] + bound1(n) >= L) cand.push_back(static_cast<int32_t>(n));
      }
      if (cnt_out) cnt_out[r] = ok ? static_cast<int64_t>(cand.size()) : -1;
      int64_t best = -1;
      if (ok && !cand.empty() && static_cast<int64_t>(cand.size()) <= cap) {
        float bv = 0.f;
        int64_t done = -1;                     // candidates in ascending order: each panel computed once
        for (const int32_t c : cand) {
          const int64_t pan = c / PANEL;
          if (pan != done) {
            row_tile(1, xr, K, pp, pan, pan + 1, full.data(), N);
            done = pan;
          }
          const float y = full[c];
          if (!std::isfinite(y)) { best = -1; break; }
          if (best < 0 || y > bv) { best = c; bv = y; }   // ascending ids: a tie keeps the first
        }
      }
      if (best < 0) {                           // the full head, as the tiled kernel gives it
        tiled_gemm(xr, 1, K, pp, nullptr, full.data(), N);
        best = argmax_row(full.data(), N);
      }
      out[r] = best;
    }
  });
  return out;
}

// y = x W^T (+ bias) from Python on a panelled weight: `check` its layout, then `run` without the GIL
template <class Check, class Run>
torch::Tensor panel_linear(const char* name, torch::Tensor x, const torch::Tensor& P, const torch::Tensor& bias,
                           int64_t N, const Check& check, const Run& run) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, name, ": x must be [M, K] float32");
  check(P, N, x.size(1));
  x = x.contiguous();
  const torch::Tensor b = bias.defined() && bias.numel() ? bias.contiguous() : torch::Tensor();
  py::gil_scoped_release nogil;
  return run(x, P, b, N);
}

torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor P, torch::Tensor bias, int64_t N) {
  return panel_linear("tiled_linear", x, P, bias, N, check_panels, tiled_linear_t);
}

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor P, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(HAS_BF16_PREFILL, NO_BF16_PREFILL);
  return panel_linear("bf16_linear", x, P, bias, N, check_panels_bf16, bf16_linear_t);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.doc() = "specbuild fused CPU decode step and block-quantized (Q4_1, Q8_0) GEMV kernels";
  py::class_<Linear>(mod, "Linear");
  mod.def("make_linear", &make_linear);
  mod.def("block_linear", &block_linear, "y = x @ W^T (+ bias) for a Q4_1 (kind 1) / Q8_0 (kind 2) W; "
          "kinds 6 / 7: the same on int8 activations");
  mod.def("tiled_linear", &tiled_linear, "y = x @ W^T (+ bias) on the tiled kernel, W as pack_panels(W), N outputs");
  mod.def("screened_argmax", &screened_argmax, "a greedy draft's tokens: x [M, K] on a Q4_1 head's candidates, "
          "decided on its Q8_0 head (both interleaved), N outputs");
  mod.def("bounded_argmax", &bounded_argmax, "an fp32 head's greedy tokens: x [M, K] screened on its Q8_0 copy "
          "(interleaved) with a proven bound, decided on its panels; -> the full head's argmax", py::arg("x"),
          py::arg("qs8"), py::arg("d8"), py::arg("norms"), py::arg("panels"), py::arg("N"), py::arg("cap"),
          py::arg("counts") = torch::Tensor());
  mod.def("argmax_rows", &argmax_rows, "x [M, N] float32 -> each row's argmax as torch.argmax(-1) gives it");
  mod.def("pack_panels", &pack_panels, "W [N, K] fp32 -> the tiled kernel's panels [ceil(N / 16), K, 16]");
  mod.def("pack_panels_bf16", &pack_panels_bf16,
          "W [N, K] fp32 -> the bf16 prefill's panels [ceil(N / 16), K / 2, 16, 2]");
  mod.def("bf16_linear", &bf16_linear, "y = x @ W^T (+ bias) with x and W rounded to bf16, fp32 sums (the bf16 "
          "prefill), W as pack_panels_bf16(W)");
  mod.def("has_bf16_prefill", []() { return HAS_BF16_PREFILL; }, "was this build compiled with AVX-512 BF16?");
  mod.def("with_bf16_prefill", &with_bf16_prefill, "a Linear with a bf16 copy for prompts' rows");
  py::class_<Runner>(mod, "Runner")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor, torch::Tensor,
                    std::vector<torch::Tensor>, std::vector<torch::Tensor>>())
      .def("add_layer", &Runner::add_layer)
      .def("forward", &Runner::forward, py::arg("x"), py::arg("slots"), py::arg("pos"), py::arg("first") = 0,
           py::arg("last") = -1, py::arg("prefill") = false)
      .def("num_layers", [](const Runner& r) { return r.num_layers(); });
}
