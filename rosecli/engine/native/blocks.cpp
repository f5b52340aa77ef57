// CPU matmuls that read a GGUF's own 4-bit and 8-bit blocks (rosecli.engine.native).
//
// y[n, N] = x[n, K] @ W[N, K]^T with W in blocks of 32 along K:
//   q4: w = d * q + m, q in 0..15 (Q4_1; Q4_0 is m = -8 d), d and m float16 per block
//   q8: w = d * q, q in -127..127 (Q8_0), d float16 per block
// The activations are rounded to 16-bit integers with one float scale per block of 32 (relative
// error <= 2^-16 of the block's largest value, where bfloat16 rounds each value by up to 2^-9), and
// each block's dot product is exact in int32 (AVX-512 VNNI vpdpwssd), scaled in float32.
//
// Layouts (made by quant.py; K a multiple of 64, blocks taken in pairs b, b+1):
//   q4 codes [N, K/2] bytes: per pair 32 bytes, block b's 16 then block b+1's; byte i of a block
//      holds q[i] in its low nibble and q[i + 16] in its high nibble (GGUF's order).
//   q4 dm [N, K/64, 4] float16: per pair (d_b, d_b+1, m_b, m_b+1).
//   q8 codes [N, K] int8: per pair 64 bytes: b[0:16], b+1[0:16], b[16:32], b+1[16:32].
//   q8 d [N, K/32] float16.
// Activations are laid out the same way per pair (64 int16: b[0:16], b+1[0:16], b[16:32],
// b+1[16:32]) so that 32-bit lane j of a product holds block b for j < 8 and b+1 for j >= 8.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <omp.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

// Threads: rose's own pool for the decode step's matmuls and attention, not OpenMP. libgomp (torch's, which this library shared) spins a waiting
// thread only while the process's OpenMP threads, summed over every host thread that has started a
// parallel region, are no more than the CPUs; past that it spins 100 times and sleeps in the kernel.
// A decode step is ~150 parallel regions, so on 2 CPUs a step started from any thread but the main
// one (the streaming manager's worker, the server's) woke sleeping threads 150 times and ran at 0.4x
// (docs/cpu.md). This pool's workers spin for SPIN_NS after each region, whichever thread called,
// then sleep on a condition variable; the calling thread runs part 0.
namespace {

constexpr int64_t SPIN_NS = 3000000;  // what libgomp spins when not throttled (about 3 ms)

struct Pool {
  std::mutex call;                     // one parallel region at a time
  std::mutex mu;                       // sleeping workers
  std::condition_variable cv;
  std::atomic<uint64_t> gen{0};        // (region number << 8) | its thread count
  std::atomic<int> pending{0};         // workers of this region not yet done
  std::atomic<int> sleepers{0};
  void (*fn)(void*, int, int) = nullptr;
  void* ctx = nullptr;
  int started = 0;                     // workers (ids 1..started)
};

Pool* pool_ = nullptr;
std::once_flag pool_once_;

void pool_reset_after_fork() { pool_ = new Pool(); }  // the child has none of the parent's threads

Pool* pool() {
  std::call_once(pool_once_, [] {
    pool_ = new Pool();  // never freed: detached workers may outlive static destructors at exit
    pthread_atfork(nullptr, nullptr, pool_reset_after_fork);
  });
  return pool_;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::steady_clock::now().time_since_epoch()).count();
}

void worker(Pool* p, int id, uint64_t seen) {
  for (;;) {
    uint64_t g;
    int64_t until = now_ns() + SPIN_NS;
    for (int k = 1; (g = p->gen.load(std::memory_order_acquire)) == seen; ++k) {
      _mm_pause();
      if ((k & 255) == 0 && now_ns() > until) {
        std::unique_lock<std::mutex> lk(p->mu);
        p->sleepers.fetch_add(1);
        p->cv.wait(lk, [&] { return p->gen.load() != seen; });
        p->sleepers.fetch_sub(1);
      }
    }
    seen = g;
    // the region's thread count travels in the generation word: a worker left out of it never reads
    // fn/ctx, and one taking part holds the region open (pending) until it is done with them
    if (id < (int)(g & 255)) {
      p->fn(p->ctx, id, (int)(g & 255));
      p->pending.fetch_sub(1, std::memory_order_release);
    }
  }
}

// fn(ctx, i, n) for i in 0..n-1, part 0 on the calling thread; returns when all are done.
void run_parallel(int n, void (*fn)(void*, int, int), void* ctx) {
  if (n <= 1) {
    fn(ctx, 0, 1);
    return;
  }
  Pool* p = pool();
  std::lock_guard<std::mutex> call(p->call);
  while (p->started < n - 1) {
    std::thread(worker, p, ++p->started, p->gen.load()).detach();
  }
  p->fn = fn;
  p->ctx = ctx;
  p->pending.store(n - 1, std::memory_order_relaxed);
  // seq_cst: a worker going to sleep sees the new generation, or we see it among the sleepers
  p->gen.store((((p->gen.load() >> 8) + 1) << 8) | (uint64_t)n);
  if (p->sleepers.load() > 0) {
    std::lock_guard<std::mutex> lk(p->mu);
    p->cv.notify_all();
  }
  fn(ctx, 0, n);
  for (int k = 1; p->pending.load(std::memory_order_acquire) != 0; ++k) {
    _mm_pause();
    if ((k & 4095) == 0) sched_yield();  // a worker lost its core: let it have ours
  }
}

// for (i = 0; i < count; ++i) body(i), split into `threads` equal ranges (OpenMP's static schedule).
template <class F>
void parallel_for(int threads, int count, const F& body) {
  if (threads > count) threads = count;
  if (threads > 255) threads = 255;
  if (threads <= 1) {
    for (int i = 0; i < count; ++i) body(i);
    return;
  }
  struct Job { const F* body; int count; } job{&body, count};
  run_parallel(threads, [](void* c, int t, int nt) {
    const Job* j = (const Job*)c;
    const int q = j->count / nt, r = j->count % nt;
    const int lo = t * q + (t < r ? t : r), hi = lo + q + (t < r ? 1 : 0);
    for (int i = lo; i < hi; ++i) (*j->body)(i);
  }, &job);
}

}  // namespace

extern "C" {

int rose_blocks_version() { return 4; }

// One activation row, prepared once per matmul: xq [P][64] int16, sv [P][16] (each lane's block
// scale), bs [P][16] (each lane's block sum / 8, for the q4 offsets).
static void prepare_x(const float* x, int K, int16_t* xq, float* sv, float* bs) {
  const int P = K / 64;
  for (int p = 0; p < P; ++p) {
    for (int h = 0; h < 2; ++h) {  // block 2p + h
      const float* xb = x + (2 * p + h) * 32;
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < 32; ++i) {
        float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;
        sum += xb[i];
      }
      float s = amax / 32767.f;
      float inv = amax > 0.f ? 32767.f / amax : 0.f;
      int16_t* out = xq + p * 64;
      for (int i = 0; i < 16; ++i) {
        out[h * 16 + i] = (int16_t)lrintf(xb[i] * inv);
        out[32 + h * 16 + i] = (int16_t)lrintf(xb[16 + i] * inv);
      }
      for (int j = 0; j < 8; ++j) {
        sv[p * 16 + h * 8 + j] = s;
        bs[p * 16 + h * 8 + j] = sum * 0.125f;
      }
    }
  }
}

static inline float q4_row(const uint8_t* codes, const uint16_t* dm, const int16_t* xq, const float* sv,
                           const float* bs, int P) {
  const __m512i lo_mask = _mm512_set1_epi16(0x0F);
  const __m512i idx_d = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i idx_m = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc = _mm512_setzero_ps(), acc_m = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(codes + 32 * p)));
    __m512i lo = _mm512_and_si512(w, lo_mask);
    __m512i hi = _mm512_srli_epi16(w, 4);
    __m512i isum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq + 64 * p));
    isum = _mm512_dpwssd_epi32(isum, hi, _mm512_loadu_si512(xq + 64 * p + 32));
    __m512 dm4 = _mm512_zextps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(dm + 4 * p))));
    __m512 d = _mm512_permutexvar_ps(idx_d, dm4);
    __m512 m = _mm512_permutexvar_ps(idx_m, dm4);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, _mm512_loadu_ps(sv + 16 * p)), acc);
    acc_m = _mm512_fmadd_ps(m, _mm512_loadu_ps(bs + 16 * p), acc_m);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc, acc_m));
}

static inline float q8_row(const int8_t* codes, const uint16_t* d, const int16_t* xq, const float* sv, int P) {
  const __m512i idx_d = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p) {
    __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(codes + 64 * p)));
    __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(codes + 64 * p + 32)));
    __m512i isum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xq + 64 * p));
    isum = _mm512_dpwssd_epi32(isum, w1, _mm512_loadu_si512(xq + 64 * p + 32));
    uint32_t d2bits;
    memcpy(&d2bits, d + 2 * p, 4);
    __m512 d2 = _mm512_zextps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)d2bits)));
    __m512 dv = _mm512_permutexvar_ps(idx_d, d2);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, _mm512_loadu_ps(sv + 16 * p)), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// kind 4: q4 (codes uint8 [N, K/2], scales = dm [N, K/64, 4]); kind 8: q8 (codes int8 [N, K], scales = d
// [N, K/32]). x [n, K] float32 rows; y [n, N] float32; bias (or NULL) [N].
static int blocks_mm(int kind, const float* x, int n, int K, const void* codes, const uint16_t* scales,
                     const float* bias, float* y, int N, int threads) {
  if (K % 64 != 0 || n <= 0 || N <= 0) return 1;
  const int P = K / 64;
  int16_t* xq = (int16_t*)aligned_alloc(64, (size_t)n * P * 64 * sizeof(int16_t) + 64);
  float* sv = (float*)aligned_alloc(64, (size_t)n * P * 16 * sizeof(float) + 64);
  float* bs = (float*)aligned_alloc(64, (size_t)n * P * 16 * sizeof(float) + 64);
  if (!xq || !sv || !bs) {
    free(xq); free(sv); free(bs);
    return 2;
  }
  for (int r = 0; r < n; ++r) prepare_x(x + (size_t)r * K, K, xq + (size_t)r * P * 64, sv + (size_t)r * P * 16,
                                        bs + (size_t)r * P * 16);
  parallel_for(N >= 64 ? threads : 1, N, [&](int o) {
    for (int r = 0; r < n; ++r) {
      float v;
      if (kind == 4) {
        v = q4_row((const uint8_t*)codes + (size_t)o * (K / 2), scales + (size_t)o * P * 4,
                   xq + (size_t)r * P * 64, sv + (size_t)r * P * 16, bs + (size_t)r * P * 16, P);
      } else {
        v = q8_row((const int8_t*)codes + (size_t)o * K, scales + (size_t)o * (K / 32),
                   xq + (size_t)r * P * 64, sv + (size_t)r * P * 16, P);
      }
      y[(size_t)r * N + o] = bias ? v + bias[o] : v;
    }
  });
  free(xq); free(sv); free(bs);
  return 0;
}

int rose_blocks_matmul(int kind, const float* x, int n, int K, const void* codes, const uint16_t* scales,
                       const float* bias, float* y, int N, int threads) {
  return blocks_mm(kind, x, n, K, codes, scales, bias, y, N, threads);
}

// ---- one decode step of a Llama-family model (no per-head q/k norm, no sliding window) ----------
// Every linear layer is q4 blocks; KV caches float32 [num_blocks, kv_heads, block_size, head_dim].
struct RoseLinear {
  const void* codes;
  const uint16_t* scales;
  const float* bias;  // NULL: none
};

struct RoseLayer {
  const float* ln1;
  const float* ln2;
  RoseLinear qkv, o, gate_up, down;
  float* k_cache;
  float* v_cache;
};

struct RoseModel {
  int hidden, heads, kv_heads, head_dim, intermediate, block_size, table_stride, num_layers;
  float eps, scale;
  const float* final_norm;
  const RoseLayer* layers;
};

static void add_rms_norm(const float* x, float* residual, const float* w, float eps, int D, float* out,
                         bool first) {
  float ss = 0.f;
  for (int i = 0; i < D; ++i) {
    float v = first ? x[i] : x[i] + residual[i];
    residual[i] = v;
    ss += v * v;
  }
  const float r = 1.f / sqrtf(ss / D + eps);
  for (int i = 0; i < D; ++i) out[i] = residual[i] * r * w[i];
}

static void rotate(float* v, const float* cos, const float* sin, int hd) {
  const int half = hd / 2;
  float tmp[1024];
  for (int i = 0; i < hd; ++i) tmp[i] = v[i];
  for (int i = 0; i < hd; ++i) v[i] = tmp[i] * cos[i] + tmp[i < half ? i + half : i - half] * sin[i];
}

// x [B, hidden]: the token embeddings in, the final norm's output out. cos/sin [B, head_dim]
// (`RotaryEmbedding.tables` rows); slots [B] (negative: not stored); tables [B, table_stride] block
// ids; ctx [B] tokens in the cache after this step, the new one included.
int rose_llama_decode(const RoseModel* m, int B, float* x, const float* cos, const float* sin,
                      const int64_t* slots, const int32_t* tables, const int32_t* ctx, int threads) {
  const int D = m->hidden, H = m->heads, KVH = m->kv_heads, HD = m->head_dim, I = m->intermediate;
  const int bs = m->block_size, group = H / KVH;
  const int qkv_n = (H + 2 * KVH) * HD;
  if (HD > 1024 || D % 64 || (H * HD) % 64 || I % 64) return 1;
  int max_ctx = 1;
  for (int b = 0; b < B; ++b) max_ctx = ctx[b] > max_ctx ? ctx[b] : max_ctx;
  float* residual = (float*)malloc(sizeof(float) * B * D);
  float* h = (float*)malloc(sizeof(float) * B * (I > D ? I : D));
  float* qkv = (float*)malloc(sizeof(float) * B * qkv_n);
  float* att = (float*)malloc(sizeof(float) * B * H * HD);
  float* gu = (float*)malloc(sizeof(float) * B * 2 * I);
  float* scores = (float*)malloc(sizeof(float) * (size_t)B * H * max_ctx);
  if (!residual || !h || !qkv || !att || !gu || !scores) {
    free(residual); free(h); free(qkv); free(att); free(gu); free(scores);
    return 2;
  }
  int rc = 0;
  for (int l = 0; l < m->num_layers && !rc; ++l) {
    const RoseLayer& L = m->layers[l];
    for (int b = 0; b < B; ++b) add_rms_norm(x + b * D, residual + b * D, L.ln1, m->eps, D, h + b * D, l == 0);
    rc |= blocks_mm(4, h, B, D, L.qkv.codes, L.qkv.scales, L.qkv.bias, qkv, qkv_n, threads);
    for (int b = 0; b < B; ++b) {
      float* row = qkv + (size_t)b * qkv_n;
      for (int hh = 0; hh < H + KVH; ++hh) rotate(row + hh * HD, cos + b * HD, sin + b * HD, HD);
      const int64_t s = slots[b];
      if (s >= 0) {
        const int64_t blk = s / bs, off = s % bs;
        for (int g = 0; g < KVH; ++g) {
          const size_t at = ((size_t)(blk * KVH + g) * bs + off) * HD;
          memcpy(L.k_cache + at, row + (H + g) * HD, sizeof(float) * HD);
          memcpy(L.v_cache + at, row + (H + KVH + g) * HD, sizeof(float) * HD);
        }
      }
    }
    parallel_for(threads, B * H, [&](int bh) {
      const int b = bh / H, hh = bh % H, g = hh / group, n = ctx[b];
      const float* q = qkv + (size_t)b * qkv_n + hh * HD;
      const int32_t* table = tables + (size_t)b * m->table_stride;
      float* sc = scores + (size_t)bh * max_ctx;
      float mx = -INFINITY;
      for (int t = 0; t < n; ++t) {
        const float* k = L.k_cache + ((size_t)(table[t / bs] * KVH + g) * bs + t % bs) * HD;
        float dot = 0.f;
        for (int i = 0; i < HD; ++i) dot += q[i] * k[i];
        sc[t] = dot * m->scale;
        mx = sc[t] > mx ? sc[t] : mx;
      }
      float sum = 0.f;
      for (int t = 0; t < n; ++t) {
        sc[t] = expf(sc[t] - mx);
        sum += sc[t];
      }
      float* o = att + (size_t)b * H * HD + hh * HD;
      for (int i = 0; i < HD; ++i) o[i] = 0.f;
      const float inv = 1.f / sum;
      for (int t = 0; t < n; ++t) {
        const float* v = L.v_cache + ((size_t)(table[t / bs] * KVH + g) * bs + t % bs) * HD;
        const float p = sc[t] * inv;
        for (int i = 0; i < HD; ++i) o[i] += p * v[i];
      }
    });
    rc |= blocks_mm(4, att, B, H * HD, L.o.codes, L.o.scales, L.o.bias, x, D, threads);
    for (int b = 0; b < B; ++b) add_rms_norm(x + b * D, residual + b * D, L.ln2, m->eps, D, h + b * D, false);
    rc |= blocks_mm(4, h, B, D, L.gate_up.codes, L.gate_up.scales, L.gate_up.bias, gu, 2 * I, threads);
    for (int b = 0; b < B; ++b) {
      const float* g = gu + (size_t)b * 2 * I;
      float* a = h + (size_t)b * I;
      for (int i = 0; i < I; ++i) a[i] = g[i] / (1.f + expf(-g[i])) * g[I + i];
    }
    rc |= blocks_mm(4, h, B, I, L.down.codes, L.down.scales, L.down.bias, x, D, threads);
  }
  for (int b = 0; b < B && !rc; ++b) {
    add_rms_norm(x + b * D, residual + b * D, m->final_norm, m->eps, D, h, false);
    memcpy(x + b * D, h, sizeof(float) * D);
  }
  free(residual); free(h); free(qkv); free(att); free(gu); free(scores);
  return rc;
}

// The float32 weights [N, K] the blocks hold (for many-row inputs: prefill multiplies them with torch).
// Prefill calls this between torch's matmuls, so it runs on OpenMP's threads, which are torch's (the
// process has one libgomp.so.1, torch's): two sets of threads taking turns would each spin on the
// other's cores.
int rose_blocks_dequant(int kind, const void* codes, const uint16_t* scales, int N, int K, float* w, int threads) {
  if (K % 64 != 0) return 1;
  const int P = K / 64;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int o = 0; o < N; ++o) {
    float* row = w + (size_t)o * K;
    for (int p = 0; p < P; ++p) {
      for (int h = 0; h < 2; ++h) {
        float* out = row + (2 * p + h) * 32;
        if (kind == 4) {
          const uint8_t* c = (const uint8_t*)codes + (size_t)o * (K / 2) + 32 * p + 16 * h;
          const float d = _cvtsh_ss(scales[((size_t)o * P + p) * 4 + h]);
          const float m = _cvtsh_ss(scales[((size_t)o * P + p) * 4 + 2 + h]);
          for (int i = 0; i < 16; ++i) {
            out[i] = d * (float)(c[i] & 0x0F) + m;
            out[16 + i] = d * (float)(c[i] >> 4) + m;
          }
        } else {
          const int8_t* c = (const int8_t*)codes + (size_t)o * K + 64 * p;
          const float d = _cvtsh_ss(scales[(size_t)o * (K / 32) + 2 * p + h]);
          for (int i = 0; i < 16; ++i) {
            out[i] = d * (float)c[16 * h + i];
            out[16 + i] = d * (float)c[32 + 16 * h + i];
          }
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
