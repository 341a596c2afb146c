"""Attention of a CPU decode or verification step over the paged KV cache, in C, beside its torch reference.

`paged_attention` stores this step's keys/values at their slots of dense pages [KVH, slots, D], then computes each new token's causal attention over its request's context, read through the block table where it lies
(no gather into a contiguous copy, no division per key: a page's rows are walked in order); the query heads of a
KV group read their KV head's rows. Pages hold float32, float16 or bfloat16 elements (`AttentionPlan.kv_dtype`):
this step's rows are rounded into them as torch converts, and every element read is widened to float32 exactly
(vcvtph2ps, a 16-bit shift), so the arithmetic below is the same for each type; half-width pages halve the
bytes a long context reads per token, which at a few thousand tokens is most of a decode step's traffic. Per query row: scores q.k * scale (a D/16-vector dot product, reduced once),
softmax as exp(s - max) * (1 / sum) with kernels/cpu_ops.py's exp and fixed-order sum, then sum_j p_j v_j. Every
row alone and the same way whatever the batch, so a verification step gives each token the scores plain decoding
gives it. `AttentionPlan` is the step's metadata, built once a step (engine/kv_batch.py) and read by every layer.
`paged_attention_ref` is the plain torch version tests/kernels/test_cpu_ops.py holds it to (and
kernels/attention.paged_attention_reference, the reference of every page format).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from specchat.kernels import cpu_build, cpu_ops, kv_quant, mxfp4

MAX_HEAD_DIM = 256  # the kernel keeps a query row's output in registers (16 floats per vector)
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # dense page element types the kernel reads
QUANTIZED_TYPES = {"mxfp8": 3, "mxfp4": 4}  # quantized ones (kernels/kv_quant.py element formats)
QUANTIZED_PAIRS = (("mxfp8", "mxfp4"), ("mxfp4", "mxfp4"))  # (keys, values) the kernel is built for: k8v4, mxfp4

C_SOURCE = r"""
/* The step as the attention kernel sees it (built once per step; AttentionPlan in cpu_attention.py). */
typedef struct {
  int batch, heads, kv_heads, head_dim, page_size, table_width, tokens;
  int k_type, v_type;      /* page elements (KV_F32, KV_F16, KV_BF16, KV_MX8, KV_MX4) of the keys and values */
  long num_slots;
  float scale;
  const int32_t* tables;   /* [batch, table_width] pages of each request */
  const int32_t* q_starts; /* [batch] first row of each request in q */
  const int32_t* q_lens;   /* [batch] */
  const int32_t* ctx_lens; /* [batch] */
  const int64_t* slots;    /* [tokens] where this step's keys/values go */
} Plan;

#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_MX8 3 /* MXFP8 (E4M3) codes, an E8M0 scale per 32 (kernels/kv_quant.py): written by torch */
#define KV_MX4 4 /* MXFP4 (E2M1) codes, element 2j in the low nibble of byte j, an E8M0 scale per 32 */
#define KV_BYTES(T) ((T) == KV_F32 ? 4 : 2)
#define KV_DENSE(T) ((T) <= KV_BF16)

/* One KV head's pages as the kernel reads them: the elements (dense), or the codes and their block scales. */
typedef struct {
  const void* data;
  const uint8_t* scales;
} Pages;

/* 2^(s - 127) for an E8M0 scale code s (NaN for 0xFF), exactly. */
INLINE float e8m0_float(uint8_t s) {
  const uint32_t bits = s == 0xFF ? 0x7FC00000u : s == 0 ? 0x00400000u : (uint32_t)s << 23;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* An E4M3 code as its value: the sign and the 7 magnitude bits placed at float32 bits 31 and 26..20 give the
   value times 2^-120 (exponent 0 lands on float32 subnormals, which are exactly E4M3's); one exact multiply. */
INLINE float e4m3_float(uint8_t c) {
  const uint32_t bits = ((uint32_t)(c & 0x80) << 24) | ((uint32_t)(c & 0x7F) << 20);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

static const float E2M1_VALUES[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* binary16 -> float32, exact (subnormals: m * 2^-24, exact in float32). */
INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits = sign;
  if (e == 0x1F) bits |= 0x7F800000 | (m << 13);
  else if (e != 0) bits |= ((e + 112) << 23) | (m << 13);
  else if (m != 0) {
    const float f = (float)m * 5.9604644775390625e-8f;
    uint32_t fb;
    memcpy(&fb, &f, sizeof fb);
    bits |= fb;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* float32 -> binary16, rounded to nearest even as torch's .half() (IEEE): normals by a biased add on the bits;
   below 2^-14, 0.5 + |f| leaves round(|f| * 2^24) in its low mantissa bits. */
INLINE uint16_t float_to_half(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7FFFFFFF;
  if (a > 0x7F800000) return sign | 0x7E00 | (uint16_t)((a >> 13) & 0x3FF); /* NaN */
  if (a >= 0x477FF000) return sign | 0x7C00;                               /* rounds past 65504 */
  if (a >= 0x38800000) {
    const uint32_t r = a - 0x38000000;
    return sign | (uint16_t)((r + 0xFFF + ((r >> 13) & 1)) >> 13);
  }
  float fa, sum;
  memcpy(&fa, &a, sizeof fa);
  sum = fa + 0.5f;
  uint32_t b;
  memcpy(&b, &sum, sizeof b);
  return sign | (uint16_t)(b - 0x3F000000);
}

/* float32 -> bfloat16 as torch rounds it (nearest even; any NaN -> 0x7FC0). */
INLINE uint16_t float_to_bf16(float f) {
  uint32_t x;
  memcpy(&x, &f, sizeof x);
  if ((x & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
  return (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

/* Element i of a KV head's pages of type T, as float32 (quantized: its code's value times its block's scale,
   one float32 product, as kv_quant's dequantization computes it). */
INLINE float kv_get(Pages pg, size_t i, const int T) {
  if (T == KV_MX8) return e4m3_float(((const uint8_t*)pg.data)[i]) * e8m0_float(pg.scales[i / 32]);
  if (T == KV_MX4) {
    const uint8_t byte = ((const uint8_t*)pg.data)[i / 2];
    return E2M1_VALUES[i % 2 ? byte >> 4 : byte & 0xF] * e8m0_float(pg.scales[i / 32]);
  }
  const void* base = pg.data;
  if (T == KV_F32) return ((const float*)base)[i];
  const uint16_t h = ((const uint16_t*)base)[i];
  if (T == KV_F16) return half_to_float(h);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef __F16C__
#include <immintrin.h>
#endif
/* n floats -> elements of type T at dst (rounded as torch's conversion rounds them; binary16 saturates at
   +-65504 where torch's gives an infinity, which would turn every score over the key into NaN: the CPU's default
   pages are binary16, and a model with a larger key or value should lose that element's precision, not its
   answer). */
#define HALF_MAX 65504.0f
static void kv_put(void* dst, const float* src, int n, const int T) {
  if (T == KV_F32) {
    memcpy(dst, src, (size_t)n * sizeof(float));
    return;
  }
  uint16_t* out = dst;
  int i = 0;
  if (T == KV_F16) {
#ifdef __F16C__
    const __m256 hi = _mm256_set1_ps(HALF_MAX), lo = _mm256_set1_ps(-HALF_MAX);
    for (; i + 8 <= n; i += 8) { /* max/min return their second operand for a NaN: NaN stays NaN */
      const __m256 x = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(src + i)));
      _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < n; i++) {
      const float x = src[i] > HALF_MAX ? HALF_MAX : src[i] < -HALF_MAX ? -HALF_MAX : src[i];
      out[i] = float_to_half(x);
    }
  } else {
    for (; i < n; i++) out[i] = float_to_bf16(src[i]);
  }
}

/* probs[j] = softmax(scores)[j] in place: exp(s - max), then times 1 / sum. */
static void softmax(float* s, int n) {
  float m = s[0];
  int j = 0;
#ifdef HAVE_EXP8
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, mv);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
  }
#endif
  for (; j < n; j++) m = s[j] > m ? s[j] : m;
  float acc[LANES]; /* exp and the sum in one pass, the sum lane_sum's (a prompt's softmax took 9.7% of its
                       prefill at 2,048 tokens in three passes; docs/benchmarks.md, thirty-sixth session) */
  j = exp_lanes(s, n, m, s, acc);
  for (int l = 0; j < n; j++, l++) {
    s[j] = exp_poly(s[j] - m);
    acc[l] += s[j];
  }
  const float inv = 1.0f / lanes_total(acc);
  for (j = 0; j < n; j++) s[j] *= inv;
}

INLINE float dot_plain(const float* a, Pages b, size_t at, int D, const int T) {
  float acc[LANES] = {0};
  for (int d = 0; d < D; d++) acc[d % LANES] += a[d] * kv_get(b, at + d, T);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

/* The first element of the page holding key j0 (a page boundary) in one KV head's pages. */
INLINE size_t page_at(const Plan* p, const int32_t* table, int j0) {
  return (size_t)table[j0 / p->page_size] * p->page_size * p->head_dim;
}

/* One query row of one head over its n keys: K/V rows of its KV head found through the block table, a page at a
   time (positions j0 .. j0 + len - 1 lie in page table[j0 / ps], consecutive rows: no division per key). */
INLINE void attend_plain(const int TK, const int TV, const Plan* p, const int32_t* table, int n, const float* q,
                         Pages kp, Pages vp, float* s, float* out) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j0 = 0; j0 < n; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++) s[j0 + j] = dot_plain(q, kp, k + (size_t)j * D, D, TK) * p->scale;
  }
  softmax(s, n);
  for (int d = 0; d < D; d++) out[d] = 0.0f;
  for (int j0 = 0; j0 < n; j0 += ps) {
    const size_t v = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++)
      for (int d = 0; d < D; d++) out[d] += s[j0 + j] * kv_get(vp, v + (size_t)j * D + d, TV);
  }
}

#ifdef __AVX512F__
#include <immintrin.h>
/* Elements i .. i + 15 of a page array of type T as floats (binary16 by vcvtph2ps, bfloat16 by a shift). */
INLINE __m512 kv_load16(Pages pg, size_t i, const int T) {
  if (T == KV_MX8) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)((const uint8_t*)pg.data + i)));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), 20));
    const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
    return _mm512_mul_ps(v, _mm512_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  if (T == KV_MX4) {
    uint64_t w;
    memcpy(&w, (const uint8_t*)pg.data + i / 2, sizeof w);
    const __m128i b = _mm_cvtsi64_si128((long long)w), low = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibbles), _mm512_loadu_ps(E2M1_VALUES));
    return _mm512_mul_ps(v, _mm512_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  const void* base = pg.data;
  if (T == KV_F32) return _mm512_loadu_ps((const float*)base + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i));
  if (T == KV_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 vectors -> one whose lane i is the sum of vector i's lanes: pairs of lanes added within 128-bit lanes (two
   unpack levels), then the four 128-bit lanes across vectors (two shuffle levels): 45 operations for 16 keys, where
   _mm512_reduce_add_ps takes 8 a key. */
INLINE __m512 sum16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* Scores of one row (query vectors qv) for keys from..n - 1 (from: a page boundary), page by page as every row of
   this build scores them: in a page, 16 keys at a time (sum16), its keys past the last 16 one at a time. */
INLINE void score_keys(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                       const __m512* qv, float* s, Pages kp) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j0 = from; j0 < n; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    int j = 0;
    for (; j + 16 <= len; j += 16) {
      __m512 d[16];
      for (int u = 0; u < 16; u++) {
        const size_t kj = k + (size_t)(j + u) * D;
        d[u] = _mm512_mul_ps(qv[0], kv_load16(kp, kj, T));
        for (int c = 1; c < NC; c++) d[u] = _mm512_fmadd_ps(qv[c], kv_load16(kp, kj + 16 * c, T), d[u]);
      }
      _mm512_storeu_ps(s + j0 + j, _mm512_mul_ps(sum16(d), _mm512_set1_ps(p->scale)));
    }
    for (; j < len; j++) {
      const size_t kj = k + (size_t)j * D;
      __m512 d = _mm512_mul_ps(qv[0], kv_load16(kp, kj, T));
      for (int c = 1; c < NC; c++) d = _mm512_fmadd_ps(qv[c], kv_load16(kp, kj + 16 * c, T), d);
      s[j0 + j] = _mm512_reduce_add_ps(d) * p->scale;
    }
  }
}

/* acc (NC vectors) += sum over keys from..n - 1 of s[j] v_j, in key order. */
INLINE void add_values(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                       const float* s, __m512* acc, Pages vp) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j = from; j < n;) {
    const int j0 = j - j % ps, end = n < j0 + ps ? n : j0 + ps;
    const size_t v = page_at(p, table, j0);
    for (; j < end; j++) {
      const __m512 w = _mm512_set1_ps(s[j]);
      for (int c = 0; c < NC; c++)
        acc[c] = _mm512_fmadd_ps(w, kv_load16(vp, v + (size_t)(j - j0) * D + 16 * c, T), acc[c]);
    }
  }
}

/* The same row with NC = D / 16 vectors per key row, a compile-time constant at each call so the output stays
   in registers: per key, one dot product (NC products summed in order), reduced 16 keys at a time (sum16), and
   NC fused adds. */
INLINE void attend_avx(const int NC, const int TK, const int TV, const Plan* p, const int32_t* table, int n,
                       const float* q, Pages kp, Pages vp, float* s, float* out) {
  __m512 qv[16], acc[16];
  for (int c = 0; c < NC; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
  score_keys(NC, TK, p, table, 0, n, qv, s, kp);
  softmax(s, n);
  for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
  add_values(NC, TV, p, table, 0, n, s, acc, vp);
  for (int c = 0; c < NC; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);
}

/* R query rows over the same KV head's pages, row r (query qs[r], output outs[r]) seeing ns[r] keys, ns[0] the
   fewest: consecutive rows of one request and head, one row of several query heads of the KV group, or both,
   with the arithmetic of attend_avx for each row, bit for bit: the keys of the pages full for every row are scored
   for all R at once, so each key row is loaded (and decoded, for quantized pages) once for R queries (a prompt's
   rows read their context from L2 R times less); each row's remaining keys, its softmax, and its sum of values in
   key order as attend_avx. R * NC <= 16 keeps the sums in registers. */
INLINE void attend_tile(const int NC, const int R, const int TK, const int TV, const Plan* p, const int32_t* table,
                        const int* ns, const float* const* qs, Pages kp, Pages vp, float* s, long s_row,
                        float* const* outs) {
  const int n = ns[0];
  const int D = p->head_dim, ps = p->page_size, full = n / ps * ps;
  __m512 qv[4][16], acc[4][16];
  _Alignas(64) float dots[4][16][16];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < NC; c++) qv[r][c] = _mm512_loadu_ps(qs[r] + 16 * c);
  for (int j0 = 0; j0 < full; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    int j = 0;
    for (; j + 16 <= ps; j += 16) {
      for (int u = 0; u < 16; u++) {
        const size_t kj = k + (size_t)(j + u) * D;
        __m512 kv[16];
        for (int c = 0; c < NC; c++) kv[c] = kv_load16(kp, kj + 16 * c, TK);
        for (int r = 0; r < R; r++) {
          __m512 d = _mm512_mul_ps(qv[r][0], kv[0]);
          for (int c = 1; c < NC; c++) d = _mm512_fmadd_ps(qv[r][c], kv[c], d);
          _mm512_store_ps(dots[r][u], d);
        }
      }
      for (int r = 0; r < R; r++) {
        __m512 d[16];
        for (int u = 0; u < 16; u++) d[u] = _mm512_load_ps(dots[r][u]);
        _mm512_storeu_ps(s + r * s_row + j0 + j, _mm512_mul_ps(sum16(d), _mm512_set1_ps(p->scale)));
      }
    }
    for (; j < ps; j++) {
      const size_t kj = k + (size_t)j * D;
      for (int r = 0; r < R; r++) {
        __m512 d = _mm512_mul_ps(qv[r][0], kv_load16(kp, kj, TK));
        for (int c = 1; c < NC; c++) d = _mm512_fmadd_ps(qv[r][c], kv_load16(kp, kj + 16 * c, TK), d);
        s[r * s_row + j0 + j] = _mm512_reduce_add_ps(d) * p->scale;
      }
    }
  }
  for (int r = 0; r < R; r++) {
    score_keys(NC, TK, p, table, full, ns[r], qv[r], s + r * s_row, kp);
    softmax(s + r * s_row, ns[r]);
    for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
  }
  for (int j0 = 0; j0 < n; j0 += ps) { /* keys every row sees, in order */
    const size_t v = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    for (int j = 0; j < len; j++) {
      __m512 vv[16];
      for (int c = 0; c < NC; c++) vv[c] = kv_load16(vp, v + (size_t)j * D + 16 * c, TV);
      for (int r = 0; r < R; r++) {
        const __m512 w = _mm512_set1_ps(s[r * s_row + j0 + j]);
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    add_values(NC, TV, p, table, n, ns[r], s + r * s_row, acc[r], vp);
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(outs[r] + 16 * c, acc[r][c]);
  }
}
#define HAVE_TILE 1
#define VEC_FLOATS 16
#define attend_vec attend_avx
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* Elements i .. i + 7 of a page array of type T as floats. */
INLINE __m256 kv_load8(Pages pg, size_t i, const int T) {
  if (T == KV_MX8) {
    uint64_t w;
    memcpy(&w, (const uint8_t*)pg.data + i, sizeof w);
    const __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)w));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24),
                                         _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), 20));
    const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
    return _mm256_mul_ps(v, _mm256_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  if (T == KV_MX4) {
    uint32_t w;
    memcpy(&w, (const uint8_t*)pg.data + i / 2, sizeof w);
    const __m128i b = _mm_cvtsi32_si128((int)w), low = _mm_set1_epi8(0x0F);
    const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
    const __m256i idx = _mm256_cvtepu8_epi32(nibbles);
    const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1_VALUES), idx); /* uses idx & 7 */
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(idx, _mm256_set1_epi32(8)), 28);
    const __m256 v = _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
    return _mm256_mul_ps(v, _mm256_set1_ps(e8m0_float(pg.scales[i / 32])));
  }
  const void* base = pg.data;
  if (T == KV_F32) return _mm256_loadu_ps((const float*)base + i);
  const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)base + i));
  if (T == KV_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* AVX2: the same walk with NC = D / 8 vectors per key row. Scores four keys at a time: four dot products in
   registers, reduced together by three horizontal adds and one cross-lane add (one reduction per key would cost
   as much as its dot product). Each row alone, whatever the batch, as above. */
INLINE __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* q . k over NC vectors in two chains (even and odd vectors), so that four keys keep eight fused adds in flight. */
INLINE __m256 dot8(const int NC, const int T, const __m256* qv, Pages kp, size_t k) {
  __m256 d0 = _mm256_mul_ps(qv[0], kv_load8(kp, k, T)), d1 = _mm256_setzero_ps();
  if (NC > 1) d1 = _mm256_mul_ps(qv[1], kv_load8(kp, k + 8, T));
  for (int c = 2; c < NC; c += 2) {
    d0 = _mm256_fmadd_ps(qv[c], kv_load8(kp, k + 8 * c, T), d0);
    d1 = _mm256_fmadd_ps(qv[c + 1], kv_load8(kp, k + 8 * c + 8, T), d1);
  }
  return _mm256_add_ps(d0, d1);
}

/* q . k for one query row (q in memory) and one key row already widened to floats (kv: NC vectors): dot8's
   arithmetic, for a tile that widens each key once for several rows. */
INLINE __m256 dot8_kv(const int NC, const float* q, const __m256* kv) {
  __m256 d0 = _mm256_mul_ps(_mm256_loadu_ps(q), kv[0]), d1 = _mm256_setzero_ps();
  if (NC > 1) d1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), kv[1]);
  for (int c = 2; c < NC; c += 2) {
    d0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), kv[c], d0);
    d1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), kv[c + 1], d1);
  }
  return _mm256_add_ps(d0, d1);
}

/* Scores of one row (query vectors qv) for keys from..n - 1, page by page, four keys at a time from `from` or the
   page's start. A key's score depends on its own dot product alone (sum4's lanes never mix), so any grouping of
   the keys gives every score the same bits. */
INLINE void score_keys8(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                        const __m256* qv, float* s, Pages kp) {
  const int D = p->head_dim, ps = p->page_size;
  const __m128 scale = _mm_set1_ps(p->scale);
  for (int j = from; j < n;) {
    const int j0 = j - j % ps, end = n < j0 + ps ? n : j0 + ps;
    const size_t k = page_at(p, table, j0);
    for (; j + 4 <= end; j += 4) {
      const size_t kj = k + (size_t)(j - j0) * D;
      const __m128 d = sum4(dot8(NC, T, qv, kp, kj), dot8(NC, T, qv, kp, kj + D), dot8(NC, T, qv, kp, kj + 2 * D),
                            dot8(NC, T, qv, kp, kj + 3 * D));
      _mm_storeu_ps(s + j, _mm_mul_ps(d, scale));
    }
    for (; j < end; j++) {
      const __m256 z = _mm256_setzero_ps();
      s[j] = _mm_cvtss_f32(sum4(dot8(NC, T, qv, kp, k + (size_t)(j - j0) * D), z, z, z)) * p->scale;
    }
  }
}

/* acc (NC vectors) += sum over keys from..n - 1 of s[j] v_j, in key order. */
INLINE void add_values8(const int NC, const int T, const Plan* p, const int32_t* table, int from, int n,
                        const float* s, __m256* acc, Pages vp) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j = from; j < n;) {
    const int j0 = j - j % ps, end = n < j0 + ps ? n : j0 + ps;
    const size_t v = page_at(p, table, j0);
    for (; j < end; j++) {
      const __m256 w = _mm256_set1_ps(s[j]);
      for (int c = 0; c < NC; c++)
        acc[c] = _mm256_fmadd_ps(w, kv_load8(vp, v + (size_t)(j - j0) * D + 8 * c, T), acc[c]);
    }
  }
}

INLINE void attend_avx2(const int NC, const int TK, const int TV, const Plan* p, const int32_t* table, int n,
                        const float* q, Pages kp, Pages vp, float* s, float* out) {
  __m256 qv[32], acc[32]; /* above 8 vectors the compiler keeps some in memory (L1) */
  for (int c = 0; c < NC; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);
  score_keys8(NC, TK, p, table, 0, n, qv, s, kp);
  softmax(s, n);
  for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
  add_values8(NC, TV, p, table, 0, n, s, acc, vp);
  for (int c = 0; c < NC; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

/* attend_tile's contract for AVX2 (R <= 4 rows, NC <= 8): each row's arithmetic is attend_avx2's, bit for bit.
   The keys every row sees are widened once for all R rows (their scores four keys at a time, as attend_avx2
   groups them), and their values added for all R rows two vectors of the output at a time (R x 2 sums and the two
   widened vectors fit AVX2's 16 registers), each sum in key order; then each row's own further keys as
   attend_avx2. */
INLINE void attend_tile(const int NC, const int R, const int TK, const int TV, const Plan* p, const int32_t* table,
                        const int* ns, const float* const* qs, Pages kp, Pages vp, float* s, long s_row,
                        float* const* outs) {
  const int n = ns[0], D = p->head_dim, ps = p->page_size, CW = NC > 1 ? 2 : 1;
  const __m128 scale = _mm_set1_ps(p->scale);
  for (int j0 = 0; j0 < n; j0 += ps) {
    const size_t k = page_at(p, table, j0);
    const int len = n - j0 < ps ? n - j0 : ps;
    int j = 0;
    for (; j + 4 <= len; j += 4) {
      __m256 d[4][4];
      for (int u = 0; u < 4; u++) {
        __m256 kv[8];
        for (int c = 0; c < NC; c++) kv[c] = kv_load8(kp, k + (size_t)(j + u) * D + 8 * c, TK);
        for (int r = 0; r < R; r++) d[r][u] = dot8_kv(NC, qs[r], kv);
      }
      for (int r = 0; r < R; r++)
        _mm_storeu_ps(s + r * s_row + j0 + j, _mm_mul_ps(sum4(d[r][0], d[r][1], d[r][2], d[r][3]), scale));
    }
    for (; j < len; j++) {
      const __m256 z = _mm256_setzero_ps();
      __m256 kv[8];
      for (int c = 0; c < NC; c++) kv[c] = kv_load8(kp, k + (size_t)j * D + 8 * c, TK);
      for (int r = 0; r < R; r++)
        s[r * s_row + j0 + j] = _mm_cvtss_f32(sum4(dot8_kv(NC, qs[r], kv), z, z, z)) * p->scale;
    }
  }
  for (int r = 0; r < R; r++) {
    __m256 qv[8];
    for (int c = 0; c < NC; c++) qv[c] = _mm256_loadu_ps(qs[r] + 8 * c);
    score_keys8(NC, TK, p, table, n, ns[r], qv, s + r * s_row, kp);
    softmax(s + r * s_row, ns[r]);
  }
  for (int c0 = 0; c0 < NC; c0 += CW) {
    __m256 acc[4][2];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++) acc[r][c] = _mm256_setzero_ps();
    for (int j0 = 0; j0 < n; j0 += ps) {
      const size_t v = page_at(p, table, j0) + 8 * (size_t)c0;
      const int len = n - j0 < ps ? n - j0 : ps;
      for (int j = 0; j < len; j++) {
        __m256 vv[2];
        for (int c = 0; c < CW; c++) vv[c] = kv_load8(vp, v + (size_t)j * D + 8 * c, TV);
        for (int r = 0; r < R; r++) {
          const __m256 w = _mm256_set1_ps(s[r * s_row + j0 + j]);
          for (int c = 0; c < CW; c++) acc[r][c] = _mm256_fmadd_ps(w, vv[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++) _mm256_storeu_ps(outs[r] + 8 * (c0 + c), acc[r][c]);
  }
  for (int r = 1; r < R; r++) {
    __m256 acc[8];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_loadu_ps(outs[r] + 8 * c);
    add_values8(NC, TV, p, table, n, ns[r], s + r * s_row, acc, vp);
    for (int c = 0; c < NC; c++) _mm256_storeu_ps(outs[r] + 8 * c, acc[c]);
  }
}

/* AVX2 groups: up to GROUP_PAIRS (row, query head) pairs of a prompt's rows in one KV group read their keys and
   values KEY_BLOCK keys at a time, each block widened once into float32 (`buf`) for all of them: on AVX2 a tile
   widens every binary16 / bfloat16 element in two instructions, once per 4 rows, and on an AMD EPYC (Zen 1) that
   made scoring a key cost 1.2x, and adding its value 1.4x, what they cost over float32 rows (docs/benchmarks.md,
   thirty-fifth session); a whole context widened at once is twice the bytes and left the caches. Within a block the
   pairs go 4 at a time (score_block / add_block: attend_tile's loops over float32 rows), so each pair's
   arithmetic is attend_avx2's, bit for bit: every score the same dot8, the same softmax, every output vector's sum
   in key order (a block's partial sums wait in outs). */
#define GROUP_PAIRS 32
#define KEY_BLOCK 64 /* keys, rounded up to whole pages: 16 KB of float32 at head_dim 64 */

/* buf = keys (or values) jb .. je - 1 of one KV head's pages as float32 rows (jb a page boundary). */
INLINE void widen_block(const int T, const Plan* p, const int32_t* table, Pages pg, int jb, int je, float* buf) {
  const int D = p->head_dim, ps = p->page_size;
  for (int j0 = jb; j0 < je; j0 += ps) {
    const size_t at = page_at(p, table, j0);
    const int count = (je - j0 < ps ? je - j0 : ps) * D;
    float* dst = buf + (size_t)(j0 - jb) * D;
    for (int i = 0; i < count; i += 8) _mm256_store_ps(dst + i, kv_load8(pg, at + i, T));
  }
}

/* Scores of R rows (queries qs, scores at s + r * s_row) for keys from .. to - 1, whose float32 rows start at kb
   (key jb): four keys at a time, as score_keys8. */
INLINE void score_block(const int NC, const int R, const float* const* qs, const float* kb, int jb, int from,
                        int to, float scale_f, float* s, long s_row) {
  const int D = NC * 8;
  const __m128 scale = _mm_set1_ps(scale_f);
  int j = from;
  for (; j + 4 <= to; j += 4) {
    __m256 d[4][4];
    for (int u = 0; u < 4; u++) {
      const __m256* kv = (const __m256*)(kb + (size_t)(j + u - jb) * D);
      for (int r = 0; r < R; r++) d[r][u] = dot8_kv(NC, qs[r], kv);
    }
    for (int r = 0; r < R; r++)
      _mm_storeu_ps(s + r * s_row + j, _mm_mul_ps(sum4(d[r][0], d[r][1], d[r][2], d[r][3]), scale));
  }
  for (; j < to; j++) {
    const __m256 z = _mm256_setzero_ps();
    const __m256* kv = (const __m256*)(kb + (size_t)(j - jb) * D);
    for (int r = 0; r < R; r++) s[r * s_row + j] = _mm_cvtss_f32(sum4(dot8_kv(NC, qs[r], kv), z, z, z)) * scale_f;
  }
}

/* outs[r] (NC vectors) += sum over keys from .. to - 1 of s[r * s_row + j] v_j for R rows, the values' float32 rows
   starting at vb (key jb), in key order; from == 0 starts the sums at zero. */
INLINE void add_block(const int NC, const int R, const float* s, long s_row, const float* vb, int jb, int from,
                      int to, float* const* outs) {
  const int D = NC * 8, CW = R <= 2 && NC >= 4 ? 4 : 2;
  for (int c0 = 0; c0 < NC; c0 += CW) {
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++)
        acc[r][c] = from == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(outs[r] + 8 * (c0 + c));
    for (int j = from; j < to; j++) {
      const float* v = vb + (size_t)(j - jb) * D + 8 * c0;
      __m256 vv[4];
      for (int c = 0; c < CW; c++) vv[c] = _mm256_load_ps(v + 8 * c);
      for (int r = 0; r < R; r++) {
        const __m256 w = _mm256_set1_ps(s[r * s_row + j]);
        for (int c = 0; c < CW; c++) acc[r][c] = _mm256_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < CW; c++) _mm256_storeu_ps(outs[r] + 8 * (c0 + c), acc[r][c]);
  }
}

/* The block's keys from .. to - 1 for R pairs at a time (R a compile-time constant at each call). */
#define BLOCK_ROWS(CALL, R, ...)            \
  switch (R) {                              \
    case 1: CALL(NC, 1, __VA_ARGS__); break; \
    case 2: CALL(NC, 2, __VA_ARGS__); break; \
    case 3: CALL(NC, 3, __VA_ARGS__); break; \
    default: CALL(NC, 4, __VA_ARGS__);       \
  }

/* P pairs of one KV head (pair r: query qs[r], ns[r] keys, output outs[r]; scores at s + r * s_row), a block of
   keys at a time; buf holds KEY_BLOCK rounded up to whole pages of float32 rows. */
INLINE void attend_group(const int NC, const int TK, const int TV, const Plan* p, const int32_t* table, int P,
                         const int* ns, const float* const* qs, Pages kp, Pages vp, float* s, long s_row,
                         float* const* outs, float* buf) {
  const int ps = p->page_size, block = (KEY_BLOCK + ps - 1) / ps * ps;
  int n = 0;
  for (int r = 0; r < P; r++) n = ns[r] > n ? ns[r] : n;
  for (int pass = 0; pass < 2; pass++) {
    if (pass == 1)
      for (int r = 0; r < P; r++) softmax(s + r * s_row, ns[r]);
    for (int jb = 0; jb < n; jb += block) {
      const int je = n < jb + block ? n : jb + block;
      widen_block(pass == 0 ? TK : TV, p, table, pass == 0 ? kp : vp, jb, je, buf);
      for (int t = 0; t < P; t += 4) {
        const int R = P - t < 4 ? P - t : 4;
        int lo = ns[t];
        for (int r = 1; r < R; r++) lo = ns[t + r] < lo ? ns[t + r] : lo;
        const int common = lo < je ? lo : je;
        float* st = s + t * s_row;
        if (jb < common) {
          if (pass == 0) BLOCK_ROWS(score_block, R, qs + t, buf, jb, jb, common, p->scale, st, s_row)
          else BLOCK_ROWS(add_block, R, st, s_row, buf, jb, jb, common, outs + t)
        }
        for (int r = 0; r < R; r++) { /* a pair's own further keys in this block */
          const int from = jb > lo ? jb : lo, to = ns[t + r] < je ? ns[t + r] : je;
          if (from >= to) continue;
          if (pass == 0) score_block(NC, 1, qs + t + r, buf, jb, from, to, p->scale, st + r * s_row, s_row);
          else add_block(NC, 1, st + r * s_row, s_row, buf, jb, from, to, outs + t + r);
        }
      }
    }
  }
}
#undef BLOCK_ROWS
#define HAVE_GROUP 1
#define HAVE_TILE 1
#define VEC_FLOATS 8
#define attend_vec attend_avx2
#endif

/* The key and value element types compile-time constants at each call of the row's code: KV_TYPES(CALL) expands
   CALL(TK, TV) for the plan's pair (the pool's formats: fp32, fp16, bf16, k8v4 = MXFP8 keys + MXFP4 values, mxfp4). */
#define KV_TYPES(CALL)                                      \
  switch (p->k_type * 8 + p->v_type) {                      \
    case KV_F16 * 8 + KV_F16: CALL(KV_F16, KV_F16)          \
    case KV_BF16 * 8 + KV_BF16: CALL(KV_BF16, KV_BF16)      \
    case KV_MX8 * 8 + KV_MX4: CALL(KV_MX8, KV_MX4)          \
    case KV_MX4 * 8 + KV_MX4: CALL(KV_MX4, KV_MX4)          \
    default: CALL(KV_F32, KV_F32)                           \
  }

/* The same pairs as definitions: FOR_KV_TYPES(DEFINE) expands DEFINE(TK, TV) for each, so that each pair's code is a
   function of its own (KV_FN), called through KV_TYPES. Every pair's tiles inlined into one dispatching function
   made gcc's passes superlinear in its size: the first run's build of the kernels took ~1.2x as long. */
#define FOR_KV_TYPES(DEFINE) \
  DEFINE(KV_F16, KV_F16) DEFINE(KV_BF16, KV_BF16) DEFINE(KV_MX8, KV_MX4) DEFINE(KV_MX4, KV_MX4) DEFINE(KV_F32, KV_F32)
#if defined(VEC_FLOATS) && VEC_FLOATS == 8 && defined(__GNUC__) && !defined(__clang__)
/* gcc 12.2's loop vectorizer (-O3) broke the AVX2 row at head_dim 128 (NC = 16) beside the other head_dims' rows:
   every output wrong, while the same code alone in a function was right (docs/benchmarks.md, "Forty-eighth
   session"). These loops are intrinsics already, so the pass has nothing to add to them. */
#define KV_FN_ATTRS noinline, optimize("no-tree-loop-vectorize")
#else
#define KV_FN_ATTRS noinline
#endif
/* KV_FN(RET, NAME, (PARAMS), BODY...): one pair's function. Static in a build of one translation unit; where the
   library is built as two compiled side by side (kernels/cpu_block.py), defined in the one of these kernels
   (KV_INSTANCES_DEFINE) and declared in the other (KV_INSTANCES_DECLARE), hidden outside the library. */
#if defined(KV_INSTANCES_DECLARE)
#define KV_FN(RET, NAME, PARAMS, ...) __attribute__((visibility("hidden"))) RET NAME PARAMS;
#elif defined(KV_INSTANCES_DEFINE)
#define KV_FN(RET, NAME, PARAMS, ...) \
  __attribute__((KV_FN_ATTRS, visibility("hidden"))) RET NAME PARAMS { __VA_ARGS__ }
#else
#define KV_FN(RET, NAME, PARAMS, ...) static __attribute__((KV_FN_ATTRS)) RET NAME PARAMS { __VA_ARGS__ }
#endif

#ifdef VEC_FLOATS
/* The vector build's row with NC = head_dim / VEC_FLOATS a compile-time constant at each call; other head_dims
   take the plain loops. */
#define ATTEND(D, TK, TV) \
  case D: attend_vec((D) / VEC_FLOATS, TK, TV, p, table, n, q, kp, vp, s, out); return;
#define ROW_FN(TK, TV)                                                                                        \
  KV_FN(void, attend_row_##TK##_##TV,                                                                          \
        (const Plan* p, const int32_t* table, int n, const float* q, Pages kp, Pages vp, float* s, float* out), \
        switch (p->head_dim) {                                                                                 \
          ATTEND(16, TK, TV) ATTEND(32, TK, TV) ATTEND(64, TK, TV) ATTEND(128, TK, TV) ATTEND(256, TK, TV)     \
          default: attend_plain(TK, TV, p, table, n, q, kp, vp, s, out);                                       \
        })
FOR_KV_TYPES(ROW_FN)
#undef ROW_FN
#undef ATTEND
#define ROW_T(TK, TV) attend_row_##TK##_##TV(p, table, n, q, kp, vp, s, out); return;
static void attend_row(const Plan* p, const int32_t* table, int n, const float* q, Pages kp, Pages vp, float* s,
                       float* out) {
  KV_TYPES(ROW_T)
}
#undef ROW_T
#else
#define PLAIN_T(TK, TV) attend_plain(TK, TV, p, table, n, q, kp, vp, s, out); return;
static void attend_row(const Plan* p, const int32_t* table, int n, const float* q, Pages kp, Pages vp, float* s,
                       float* out) {
  KV_TYPES(PLAIN_T)
}
#endif

/* Whether a decode row's query heads share tiles over dense pages too (see paged_attention): 2 always (AVX2), 1
   where the step's KV heads keep the threads busy (AVX-512), 0 never (plain C builds: no tiles). */
#if defined(VEC_FLOATS) && VEC_FLOATS == 8
#define PAIRED_DECODE 2
#elif defined(VEC_FLOATS)
#define PAIRED_DECODE 1
#else
#define PAIRED_DECODE 0
#endif

/* R rows (see attend_tile: row r's query qs[r], output outs[r], ns[r] keys, ns[0] the fewest): where the build
   tiles rows (AVX-512 at head_dim 16..128, AVX2 at 16..64), attend_tile; else one row at a time. The same bits
   either way: a tile does each row's arithmetic as attend_row does. */
static int tile_rows(int D) {
#ifdef HAVE_TILE
  if (D == 16 || D == 32 || D == 64) return 4;
  if (D == 128 && VEC_FLOATS == 16) return 2;
#endif
  return 1;
}

#ifdef HAVE_TILE
#define KV_TILE(NC, RR, TK, TV) \
  case RR: attend_tile(NC, RR, TK, TV, p, table, ns, qs, kp, vp, s, s_row, outs); return 1;
#define KV_TILES(D, TK, TV)                                                            \
  case D:                                                                              \
    switch (R) {                                                                       \
      KV_TILE((D) / VEC_FLOATS, 2, TK, TV)                                             \
      KV_TILE((D) / VEC_FLOATS, 3, TK, TV) KV_TILE((D) / VEC_FLOATS, 4, TK, TV)        \
    }                                                                                  \
    break;
#if VEC_FLOATS == 16
#define TILES_128(TK, TV) case 128: switch (R) { KV_TILE(8, 2, TK, TV) } break;
#else
#define TILES_128(TK, TV)
#endif
/* Whether the pair's tiles took the R rows (1), or they go one at a time (0). */
#define TILES_FN(TK, TV)                                                                                      \
  KV_FN(int, attend_tiles_##TK##_##TV,                                                                         \
        (const Plan* p, const int32_t* table, int R, const int* ns, const float* const* qs, Pages kp, Pages vp, \
         float* s, long s_row, float* const* outs),                                                            \
        switch (p->head_dim) { KV_TILES(16, TK, TV) KV_TILES(32, TK, TV) KV_TILES(64, TK, TV) TILES_128(TK, TV) } \
        return 0;)
FOR_KV_TYPES(TILES_FN)
#undef TILES_FN
#undef TILES_128
#undef KV_TILES
#undef KV_TILE
#endif

static void attend_rows(const Plan* p, const int32_t* table, int R, const int* ns, const float* const* qs, Pages kp,
                        Pages vp, float* s, long s_row, float* const* outs) {
#ifdef HAVE_TILE
#define TILES_T(TK, TV) if (attend_tiles_##TK##_##TV(p, table, R, ns, qs, kp, vp, s, s_row, outs)) return; break;
  if (R > 1) { KV_TYPES(TILES_T) }
#undef TILES_T
#endif
  for (int r = 0; r < R; r++) attend_row(p, table, ns[r], qs[r], kp, vp, s, outs[r]);
}

#ifndef HAVE_GROUP
#define GROUP_PAIRS 4 /* (the most pairs of a tile) */
#define KEY_BLOCK 0
#endif

/* Pairs of one KV head per group (attend_group) where the build groups this head_dim (AVX2 at 16..64), else 0. */
static int group_pairs(int D) {
#ifdef HAVE_GROUP
  if (D == 16 || D == 32 || D == 64) return GROUP_PAIRS;
#endif
  return 0;
}

/* Pairs per group for a prompt of `pairs` (row, query head) pairs per KV head: groups of at most GP pairs, of
   about equal size (a multiple of 4, whole tiles), so that the threads' shares of them even out. */
static int group_size(int pairs, int GP) {
  const int groups = (pairs + GP - 1) / GP;
  const int size = ((pairs + groups - 1) / groups + 3) / 4 * 4;
  return size < GP ? size : GP;
}

#ifdef HAVE_GROUP
#define GROUP(NC, TK, TV) attend_group(NC, TK, TV, p, table, P, ns, qs, kp, vp, s, s_row, outs, buf); return;
#define GROUP_FN(TK, TV)                                                                                      \
  KV_FN(void, attend_pairs_##TK##_##TV,                                                                        \
        (const Plan* p, const int32_t* table, int P, const int* ns, const float* const* qs, Pages kp, Pages vp, \
         float* s, long s_row, float* const* outs, float* buf),                                                \
        switch (p->head_dim) {                                                                                 \
          case 16: GROUP(2, TK, TV)                                                                            \
          case 32: GROUP(4, TK, TV)                                                                            \
          default: GROUP(8, TK, TV)                                                                            \
        })
FOR_KV_TYPES(GROUP_FN)
#undef GROUP_FN
#undef GROUP
#define GROUP_T(TK, TV) attend_pairs_##TK##_##TV(p, table, P, ns, qs, kp, vp, s, s_row, outs, buf); return;
static void attend_pairs(const Plan* p, const int32_t* table, int P, const int* ns, const float* const* qs,
                         Pages kp, Pages vp, float* s, long s_row, float* const* outs, float* buf) {
  KV_TYPES(GROUP_T)
}
#undef GROUP_T
#endif

/* ---- end of the kernels: the attention's own translation unit ends here (C_KERNELS) ---- */

/* ---- Quantize-on-append: kernels/kv_quant.py's quantize_rows, bit for bit, after the pages' rotation ---- */

/* How quantized pages hold this step's rows (built once a layer: kv_pages.PageStore.cpu_rotation): each row is
   rotated first (the Hadamard rotation R, and for keys the calibrated key transform A: k A R as one matrix) and
   the queries alike, so scores are unchanged; the output comes out rotated and is rotated by R again (R is its
   own inverse). */
typedef struct {
  const float* q_mat; /* queries of KV head h's group: q M, M at q_mat + h * q_head (q_head 0: one for all) */
  long q_head;
  const float* k_mat; /* keys of KV head h: k M, M at k_mat + h * k_head */
  long k_head;
  int hadamard;       /* R: the Sylvester-Hadamard rotation in blocks of this many (0: none), for values in, */
  float scale;        /* outputs out, and queries and keys without a matrix of their own; times this scale */
  int rule;           /* MXFP4 scale rule, mxfp4.RULES order: 0 ocp, 1 roundup, 2 mse */
} Rotation;

#define RULE_ROUNDUP 1
#define RULE_MSE 2

INLINE uint32_t f32_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return b;
}

INLINE float bits_f32(uint32_t b) {
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

/* 2^e exactly for e <= 127 (float32 subnormals below 2^-126, 0 below 2^-149, as torch.ldexp gives them). */
INLINE float pow2f(int e) {
  return e >= -126 ? bits_f32((uint32_t)(e + 127) << 23) : e >= -149 ? bits_f32(1u << (e + 149)) : 0.0f;
}

/* floor(log2 a) of a finite a > 0, subnormals included (torch.frexp's exponent - 1). */
INLINE int floor_log2(float a) {
  const uint32_t b = f32_bits(a);
  return b >> 23 ? (int)(b >> 23) - 127 : 31 - __builtin_clz(b) - 149;
}

/* The largest magnitude in a block of 32, or -1 when the block holds a NaN or an infinity. */
INLINE float block_amax(const float* x) {
#ifdef __AVX512F__
  const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i a0 = _mm512_and_si512(_mm512_loadu_si512(x), mask);
  const __m512i a1 = _mm512_and_si512(_mm512_loadu_si512(x + 16), mask);
  if (_mm512_cmpge_epu32_mask(a0, inf) | _mm512_cmpge_epu32_mask(a1, inf)) return -1.0f;
  return bits_f32((uint32_t)_mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1))); /* finite magnitudes order as bits */
#elif defined(__AVX2__)
  const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF), finite = _mm256_set1_epi32(0x7F7FFFFF);
  __m256i top = _mm256_setzero_si256(), bad = _mm256_setzero_si256(); /* magnitudes' bits: signed compares work */
  for (int i = 0; i < 32; i += 8) {
    const __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + i)), mask);
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(a, finite));
    top = _mm256_max_epi32(top, a);
  }
  if (!_mm256_testz_si256(bad, bad)) return -1.0f;
  uint32_t lanes[8], amax = 0;
  _mm256_storeu_si256((__m256i*)lanes, top);
  for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
  return bits_f32(amax);
#else
  float amax = 0.0f;
  uint32_t bad = 0;
  for (int i = 0; i < 32; i++) {
    const uint32_t a = f32_bits(x[i]) & 0x7FFFFFFF;
    bad |= a >= 0x7F800000;
    amax = bits_f32(a) > amax ? bits_f32(a) : amax;
  }
  return bad ? -1.0f : amax;
#endif
}

/* A float32 already divided by its block scale -> its E2M1 code (mxfp4.round_to_e2m1: the midpoints passed,
   ties to the even code, saturating at 6; the sign bit as bit 3). */
INLINE uint8_t e2m1_code(float v) {
  const uint32_t b = f32_bits(v);
  const float m = bits_f32(b & 0x7FFFFFFF);
  const int c = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) + (m > 5.0f);
  return (uint8_t)(c | (b >> 31) << 3);
}

/* |y| <= 448 -> its E4M3 code, rounded to nearest even as torch's float8_e4m3fn conversion: normals by a biased
   add on the bits, below 2^-6 by adding 2^14, whose ulp is E4M3's subnormal step 2^-9. */
INLINE uint8_t float_to_e4m3(float y) {
  const uint32_t b = f32_bits(y), a = b & 0x7FFFFFFF;
  const uint8_t sign = (uint8_t)((b >> 24) & 0x80);
  if (a >= 0x3C800000) {
    const uint32_t r = a - 0x3C000000; /* exponent bias 127 -> 7 */
    return sign | (uint8_t)((r + 0x7FFFF + ((r >> 20) & 1)) >> 20);
  }
  return sign | (uint8_t)(f32_bits(bits_f32(a) + 0x1p14f) - 0x46800000);
}

/* One block of 32 in MXFP8 (kv_quant.quantize_mxfp8): the round-up exponent 2^ceil(log2(amax / 448)), elements
   times 2^-e clamped to +-448 and rounded; a NaN or infinity makes the block NaN (scale 0xFF, codes 0). */
static void quantize_mx8(const float* x, uint8_t* codes, uint8_t* scale) {
  const float amax = block_amax(x);
  if (amax < 0.0f) {
    memset(codes, 0, 32);
    *scale = 0xFF;
    return;
  }
  int e = -127;
  if (amax > 0.0f) {
    e = floor_log2(amax) - 8;
    e += amax > 448.0f * pow2f(e);
  }
  e = e < -127 ? -127 : e > 127 ? 127 : e;
  const float inv = pow2f(-e);
  int i = 0;
#ifdef __AVX512F__
  for (; i < 32; i += 16) { /* float_to_e4m3 16 lanes at a time */
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)),
                                                 _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
    const __m512i b = _mm512_castps_si512(y), a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
    const __m512i r = _mm512_sub_epi32(a, _mm512_set1_epi32(0x3C000000));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(r, _mm512_set1_epi32(0x7FFFF)), odd), 20);
    const __m512 biased = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(0x1p14f));
    const __m512i tiny = _mm512_sub_epi32(_mm512_castps_si512(biased), _mm512_set1_epi32(0x46800000));
    const __mmask16 is_normal = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x3C800000));
    const __m512i code = _mm512_or_si512(sign, _mm512_mask_blend_epi32(is_normal, tiny, normal));
    _mm_storeu_si128((__m128i*)(codes + i), _mm512_cvtepi32_epi8(code));
  }
#elif defined(__AVX2__)
  for (; i < 32; i += 8) { /* float_to_e4m3 8 lanes at a time (magnitudes' bits: signed compares work) */
    const __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)),
                                                 _mm256_set1_ps(-448.0f)), _mm256_set1_ps(448.0f));
    const __m256i b = _mm256_castps_si256(y), a = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
    const __m256i r = _mm256_sub_epi32(a, _mm256_set1_epi32(0x3C000000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(r, _mm256_set1_epi32(0x7FFFF)), odd), 20);
    const __m256 biased = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(0x1p14f));
    const __m256i tiny = _mm256_sub_epi32(_mm256_castps_si256(biased), _mm256_set1_epi32(0x46800000));
    const __m256i is_normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x3C7FFFFF));
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i*)lanes, _mm256_or_si256(sign, _mm256_blendv_epi8(tiny, normal, is_normal)));
    for (int l = 0; l < 8; l++) codes[i + l] = (uint8_t)lanes[l];
  }
#endif
  for (; i < 32; i++) {
    const float y = x[i] * inv;
    codes[i] = float_to_e4m3(y > 448.0f ? 448.0f : y < -448.0f ? -448.0f : y);
  }
  *scale = (uint8_t)(e + 127);
}

/* One block of 32 in MXFP4 (kv_quant.quantize_mxfp4_rows): the OCP exponent floor(log2 amax) - 2, "roundup" one
   higher where amax / 2^e > 6, "mse" the least squared error among e, e + 1, e - 1 (the first of equal errors;
   float64, as 8 partial sums over elements j, j + 8, j + 16, j + 24 added pairwise, which vectorizes; the
   reference's order differs only where two candidates' errors tie to the last bit of a double); elements times
   2^-e (exact: a division by the power of two), element 2j in the low nibble of byte j. */
static void quantize_mx4(const float* x, int rule, uint8_t* codes, uint8_t* scale) {
  static const int offsets[3] = {0, 1, -1};
  const float amax = block_amax(x);
  if (amax < 0.0f) {
    memset(codes, 0, 16);
    *scale = 0xFF;
    return;
  }
  int ocp = amax > 0.0f ? floor_log2(amax) - 2 : -127;
  if (rule == RULE_ROUNDUP) ocp += amax > 6.0f * pow2f(ocp < -127 ? -127 : ocp);
  uint8_t best[32], cand[32];
  int best_e = 0;
  double best_err = 0.0;
  for (int c = 0; c < (rule == RULE_MSE ? 3 : 1); c++) {
    int e = ocp + offsets[c];
    e = e < -127 ? -127 : e > 127 ? 127 : e;
    const float s = pow2f(e), inv = pow2f(-e);
    double part[8] = {0};
#ifdef __AVX512F__
    /* e2m1_code and the squared errors 16 lanes at a time (the same operations, the same order of sums) */
    __m512d acc = _mm512_setzero_pd();
    for (int i = 0; i < 32; i += 16) {
      const __m512i b = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(inv)));
      const __m512 m = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)));
      const __m512i one = _mm512_set1_epi32(1);
      __m512i c = _mm512_setzero_si512();
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.25f), _CMP_GT_OQ), c, one);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.75f), _CMP_GE_OQ), c, one);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.25f), _CMP_GT_OQ), c, one);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.75f), _CMP_GE_OQ), c, one);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(m, _mm512_set1_ps(2.5f), _CMP_GT_OQ), c, one);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(m, _mm512_set1_ps(3.5f), _CMP_GE_OQ), c, one);
      c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(m, _mm512_set1_ps(5.0f), _CMP_GT_OQ), c, one);
      if (rule == RULE_MSE) {
        const __m512 q = _mm512_mul_ps(_mm512_permutexvar_ps(c, _mm512_loadu_ps(E2M1_VALUES)), _mm512_set1_ps(s));
        const __m512 a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(x + i)),
                                                              _mm512_set1_epi32(0x7FFFFFFF)));
        for (int h = 0; h < 2; h++) {
          const __m256 qh = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(q), h));
          const __m256 ah = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), h));
          const __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(qh), _mm512_cvtps_pd(ah));
          acc = _mm512_add_pd(acc, _mm512_mul_pd(d, d));
        }
      }
      c = _mm512_or_si512(c, _mm512_slli_epi32(_mm512_srli_epi32(b, 31), 3));
      _mm_storeu_si128((__m128i*)(cand + i), _mm512_cvtepi32_epi8(c));
    }
    _mm512_storeu_pd(part, acc);
#elif defined(__AVX2__)
    /* the same 8 lanes at a time; the float64 partial sums as two 4-lane halves (lanes 0-3, 4-7) */
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (int i = 0; i < 32; i += 8) {
      const __m256i b = _mm256_castps_si256(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)));
      const __m256 m = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)));
      __m256i c = _mm256_setzero_si256(); /* each passed midpoint subtracts its all-ones mask: adds 1 */
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(0.25f), _CMP_GT_OQ)));
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(0.75f), _CMP_GE_OQ)));
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(1.25f), _CMP_GT_OQ)));
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(1.75f), _CMP_GE_OQ)));
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(2.5f), _CMP_GT_OQ)));
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(3.5f), _CMP_GE_OQ)));
      c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(m, _mm256_set1_ps(5.0f), _CMP_GT_OQ)));
      if (rule == RULE_MSE) {
        const __m256 q = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1_VALUES), c), _mm256_set1_ps(s));
        const __m256 a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(x + i)),
                                                              _mm256_set1_epi32(0x7FFFFFFF)));
        const __m256d d_lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(q)),
                                           _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
        const __m256d d_hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(q, 1)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
        lo = _mm256_add_pd(lo, _mm256_mul_pd(d_lo, d_lo));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(d_hi, d_hi));
      }
      c = _mm256_or_si256(c, _mm256_slli_epi32(_mm256_srli_epi32(b, 31), 3));
      uint32_t lanes[8];
      _mm256_storeu_si256((__m256i*)lanes, c);
      for (int l = 0; l < 8; l++) cand[i + l] = (uint8_t)lanes[l];
    }
    _mm256_storeu_pd(part, lo);
    _mm256_storeu_pd(part + 4, hi);
#else
    for (int i = 0; i < 32; i++) cand[i] = e2m1_code(x[i] * inv);
    if (rule == RULE_MSE)
      for (int i = 0; i < 32; i += 8)
        for (int j = 0; j < 8; j++) {
          const float a = bits_f32(f32_bits(x[i + j]) & 0x7FFFFFFF);
          const double d = (double)(E2M1_VALUES[cand[i + j] & 7] * s) - (double)a;
          part[j] += d * d;
        }
#endif
    const double err = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    if (c == 0 || err < best_err) {
      memcpy(best, cand, 32);
      best_e = e;
      best_err = err;
    }
  }
  for (int j = 0; j < 16; j++) codes[j] = (uint8_t)(best[2 * j] | best[2 * j + 1] << 4);
  *scale = (uint8_t)(best_e + 127);
}

/* One row x [D] into codes and scales of quantized type T (D a multiple of 32). */
static void quantize_row(const float* x, int D, int T, int rule, uint8_t* codes, uint8_t* scales) {
  for (int b = 0; b < D / 32; b++) {
    if (T == KV_MX8) quantize_mx8(x + 32 * b, codes + 32 * b, scales + b);
    else quantize_mx4(x + 32 * b, rule, codes + 16 * b, scales + b);
  }
}

/* y = x M for one row, M [D, D] row-major: y[e] = x[0] M[0][e] + x[1] M[1][e] + ... in that order, float32
   products and sums (cpu_attention.rotate_rows_ref, bit for bit). y must not alias x. */
static void rotate_row(int D, const float* x, const float* m, float* y) {
  for (int e = 0; e < D; e++) y[e] = x[0] * m[e];
  for (int d = 1; d < D; d++) {
    const float xd = x[d], *row = m + (size_t)d * D;
    for (int e = 0; e < D; e++) y[e] += xd * row[e];
  }
}

/* y = x R for the Sylvester-Hadamard matrix in blocks of B (a power of two) times `scale`, by butterflies: in
   each block, for h = 1, 2, 4, ..., B / 2, every pair (j, j + h) of a group of 2h becomes (a + b, a - b); then each
   element times the scale (cpu_attention.hadamard_rows_ref, bit for bit). B 0: y = x. */
static void hadamard_row(int D, int B, float scale, const float* x, float* y) {
  memcpy(y, x, (size_t)D * sizeof(float));
  if (B == 0) return;
  int h0 = 1; /* the first stage the loop below takes: the stages within a vector run in its lanes first */
#ifdef __AVX512F__
  if (B >= 16) { /* lane l pairs with lane l ^ h, the upper one takes b - a */
    for (int h = 1; h < 16; h *= 2) {
      const __m512i partner = _mm512_xor_si512(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(h));
      const __mmask16 upper = _mm512_test_epi32_mask(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2,
                                                                      1, 0), _mm512_set1_epi32(h));
      for (int e = 0; e < D; e += 16) {
        const __m512 a = _mm512_loadu_ps(y + e), b = _mm512_permutexvar_ps(partner, a);
        _mm512_storeu_ps(y + e, _mm512_mask_sub_ps(_mm512_add_ps(a, b), upper, b, a));
      }
    }
    h0 = 16;
  }
#elif defined(__AVX2__)
  if (B >= 8) { /* the same in 8 lanes */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int h = 1; h < 8; h *= 2) {
      const __m256i partner = _mm256_xor_si256(lane, _mm256_set1_epi32(h));
      const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_and_si256(lane, _mm256_set1_epi32(h)),
                                                                  _mm256_setzero_si256()));
      for (int e = 0; e < D; e += 8) {
        const __m256 a = _mm256_loadu_ps(y + e), b = _mm256_permutevar8x32_ps(a, partner);
        _mm256_storeu_ps(y + e, _mm256_blendv_ps(_mm256_add_ps(a, b), _mm256_sub_ps(b, a), upper));
      }
    }
    h0 = 8;
  }
#endif
  for (int o = 0; o < D; o += B)
    for (int h = h0; h < B; h *= 2)
      for (int i = o; i < o + B; i += 2 * h)
        for (int j = i; j < i + h; j++) {
          const float a = y[j], b = y[j + h];
          y[j] = a + b;
          y[j + h] = a - b;
        }
  for (int e = 0; e < D; e++) y[e] *= scale;
}

/* A query or key row into the pages' basis: its own matrix (at m) where there is one, else R. */
INLINE void rotate_in(int D, const Rotation* rot, const float* m, const float* x, float* y) {
  if (m != NULL) rotate_row(D, x, m, y);
  else hadamard_row(D, rot->hadamard, rot->scale, x, y);
}

/* Rows [n, D] (row stride `stride`) rotated (the matrix m [D, D], or else R in blocks of `hadamard` times `scale`)
   and quantized into type T: the kernel's store, exposed for the tests' bit-for-bit comparison with kv_quant
   (codes [n, code bytes], scales [n, D / 32]). */
void quantize_rows(int n, int D, int T, int rule, const float* x, long stride, const float* m, int hadamard,
                   float scale, uint8_t* codes, uint8_t* scales) {
  const Rotation rot = {NULL, 0, NULL, 0, hadamard, scale, rule};
  float y[256];
  const size_t row_codes = T == KV_MX8 ? (size_t)D : (size_t)D / 2;
  for (int i = 0; i < n; i++) {
    rotate_in(D, &rot, m, x + (size_t)i * stride, y);
    quantize_row(y, D, T, rule, codes + i * row_codes, scales + (size_t)i * (D / 32));
  }
}

/* count elements of quantized pages from element `at` on, as float32 (or binary16 where `half`, for values it holds
   exactly: `fit_half`): each its code's value times its block's scale, the values every reader of the pages
   computes, bit for bit (count a multiple of 16). */
static void dequantize_span(Pages pg, size_t at, int count, int T, void* dst, int half) {
  float* f = dst;
  uint16_t* h = dst;
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= count; i += 16) {
    const __m512 v = kv_load16(pg, at + i, T);
    if (half) _mm256_storeu_si256((__m256i*)(h + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else _mm512_storeu_ps(f + i, v);
  }
#elif defined(VEC_FLOATS)
  for (; i + 8 <= count; i += 8) {
    const __m256 v = kv_load8(pg, at + i, T);
    if (half) _mm_storeu_si128((__m128i*)(h + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else _mm256_storeu_ps(f + i, v);
  }
#endif
  for (; i < count; i++) {
    const float v = kv_get(pg, at + i, T);
    if (half) h[i] = float_to_half(v);
    else f[i] = v;
  }
}

/* Whether every value of quantized type T under these E8M0 scales is a binary16 exactly: an element's granule
   (E4M3: 2^-9, E2M1: 0.5) times the scale at least binary16's 2^-24, its largest (448, 6) times the scale at most
   65504. A NaN block (0xFF) does not fit. */
static int fit_half(const uint8_t* scales, size_t n, int T) {
  const int lo = T == KV_MX8 ? 127 - 15 : 127 - 23, hi = T == KV_MX8 ? 127 + 7 : 127 + 13;
  int fits = 1;
  for (size_t i = 0; i < n; i++) fits &= scales[i] >= lo && scales[i] <= hi;
  return fits;
}

/* Requests of at least DEQUANTIZE_ROWS rows (prompts) over quantized pages read their context decoded once into
   dense pages: each of their tiles would decode it again (a tile scores 4 rows of one head), which made a
   prompt's prefill 13-15% slower than over float32 pages (cpu_kv_formats.py). The copy is binary16 where every
   copied value fits one exactly (`fit_half`: the usual case; half the bytes to read, as fp16 pages), else
   float32. A verification's few rows decode in place instead, 4 (row, head) pairs sharing each decoded key: a
   copy's writes would cost about what they save. */
#define DEQUANTIZE_ROWS 16

/* Whether every key and value of request b's context (quantized pages: scales [KVH, num_slots, D / 32]) is a
   binary16 exactly (`fit_half`). */
static int context_fits_half(const Plan* p, int b, const uint8_t* k_scales, const uint8_t* v_scales) {
  const int D = p->head_dim, ps = p->page_size, n = p->ctx_lens[b];
  const size_t scale_head = (size_t)p->num_slots * (D / 32);
  for (int h = 0; h < p->kv_heads; h++)
    for (int j0 = 0; j0 < n; j0 += ps) {
      const size_t at = h * scale_head + page_at(p, p->tables + (size_t)b * p->table_width, j0) / 32;
      const size_t count = (size_t)(n - j0 < ps ? n - j0 : ps) * (D / 32);
      if (!fit_half(k_scales + at, count, p->k_type) || !fit_half(v_scales + at, count, p->v_type)) return 0;
    }
  return 1;
}
#define MAX_DEQUANTIZED_BYTES (64L << 20)

/* A scratch buffer of the calling thread of at least `bytes`, kept and grown (a fresh allocation of a prompt's
   size each call would be a fresh mmap and its page faults), or NULL. */
typedef struct {
  float* data;
  size_t size;
} Scratch;

static float* scratch_of(Scratch* s, size_t bytes) {
  if (bytes > s->size) {
    free(s->data);
    s->data = malloc(bytes);
    s->size = s->data != NULL ? bytes : 0;
  }
  return s->data;
}

static __thread Scratch dequantized, rotated_queries;

/* Store this step's keys/values (k/v [T, KVH, D], row strides k_stride / v_stride) at their slots of the pages
   [KVH, num_slots, ...], then out [T, H, D] = causal attention of every new row (q [T, H, D], row stride
   q_stride) over its request's context: a decode row, a verification's, a prompt's alike (each (row, head) by
   the same loop, so a row's output does not depend on what else the step holds: a prompt prefilled in one
   chunk, in several or taken from the prefix cache gives the same bits). `threads` > 1 splits the (row, head)
   pairs where the step attends over PARALLEL_KEYS keys or more, and the rows to quantize and rotate where there
   are PARALLEL_ROWS or more. Returns 0, or -1 when the scratch rows cannot be allocated. */
#define PARALLEL_KEYS 2048
#define PARALLEL_ROWS 32
/* A tile of paged_attention's work: pairs 0: rows first .. first + count - 1 of request b in query head `head`;
   pairs 1: (row, query head) pairs first .. first + count - 1 of request b in KV head `head`'s group, pair k being
   row k / G in query head head * G + k % G; pairs 2: such pairs as one group (attend_group, AVX2 builds). */
typedef struct {
  int b, first, count, head, pairs;
} Tile;

/* Bytes of one KV head's element array (codes, for the quantized types) of type T. */
static size_t head_bytes(int T, long slots, int D) {
  const size_t n = (size_t)slots * D;
  return T == KV_F32 ? 4 * n : KV_DENSE(T) ? 2 * n : T == KV_MX8 ? n : n / 2;
}

/* Keys and values: the pages [KVH, num_slots, ...] of their types (quantized: codes, and E8M0 scales
   [KVH, num_slots, D / 32]; dense: scales NULL). Dense pages get this step's rows as they are (rounded into
   half-width elements); quantized ones get them rotated and quantized (`rot`, which also rotates the queries and
   the outputs; NULL for dense pages). */
int paged_attention(const Plan* p, const float* q, long q_stride, const float* k, long k_stride, const float* v,
                    long v_stride, void* k_pages, uint8_t* k_scales, void* v_pages, uint8_t* v_scales,
                    const Rotation* rot, float* out, int threads) {
  const int D = p->head_dim, H = p->heads, KVH = p->kv_heads, G = H / KVH;
  const size_t k_head = head_bytes(p->k_type, p->num_slots, D), v_head = head_bytes(p->v_type, p->num_slots, D);
  const size_t scale_head = (size_t)p->num_slots * (D / 32);
  const long stores = (long)p->tokens * KVH;
  if (KV_DENSE(p->k_type) && KV_DENSE(p->v_type)) {
    const size_t es = KV_BYTES(p->k_type);
    for (long w = 0; w < stores; w++) {
      const int t = (int)(w / KVH), h = (int)(w % KVH);
      const size_t dst = ((size_t)h * p->num_slots + (size_t)p->slots[t]) * D * es;
      kv_put((char*)k_pages + dst, k + (size_t)t * k_stride + (size_t)h * D, D, p->k_type);
      kv_put((char*)v_pages + dst, v + (size_t)t * v_stride + (size_t)h * D, D, p->v_type);
    }
  } else {
    const size_t k_row = head_bytes(p->k_type, 1, D), v_row = head_bytes(p->v_type, 1, D);
#ifdef _OPENMP
#pragma omp parallel for if(stores >= PARALLEL_ROWS) num_threads(threads) schedule(static)
#endif
    for (long w = 0; w < stores; w++) {
      const int t = (int)(w / KVH), h = (int)(w % KVH);
      const size_t slot = (size_t)h * p->num_slots + (size_t)p->slots[t];
      float x[256];
      const float* k_mat = rot->k_mat ? rot->k_mat + h * rot->k_head : NULL;
      rotate_in(D, rot, k_mat, k + (size_t)t * k_stride + (size_t)h * D, x);
      quantize_row(x, D, p->k_type, rot->rule, (uint8_t*)k_pages + slot * k_row, k_scales + slot * (D / 32));
      hadamard_row(D, rot->hadamard, rot->scale, v + (size_t)t * v_stride + (size_t)h * D, x);
      quantize_row(x, D, p->v_type, rot->rule, (uint8_t*)v_pages + slot * v_row, v_scales + slot * (D / 32));
    }
  }
  float* rotated = NULL; /* the queries in the pages' basis */
  if (rot != NULL && (rot->q_mat != NULL || rot->hadamard)) {
    const long rows = (long)p->tokens * H;
    rotated = scratch_of(&rotated_queries, (size_t)rows * D * sizeof(float));
    if (rotated == NULL) return -1;
#ifdef _OPENMP
#pragma omp parallel for if(rows >= PARALLEL_ROWS) num_threads(threads) schedule(static)
#endif
    for (long w = 0; w < rows; w++) {
      const int t = (int)(w / H), hq = (int)(w % H);
      const float* q_mat = rot->q_mat ? rot->q_mat + hq / G * rot->q_head : NULL;
      rotate_in(D, rot, q_mat, q + (size_t)t * q_stride + (size_t)hq * D, rotated + w * D);
    }
    q = rotated;
    q_stride = (long)H * D;
  }
  const int r_out = rot != NULL ? rot->hadamard : 0;
  /* work: tiles of up to R query rows over one KV head's pages (attend_rows). For a request of fewer than
     DEQUANTIZE_ROWS rows (a verification; a decode step over quantized pages), R (row, query head) pairs of one KV
     group, rows outer, so each key is loaded (decoded) once for them: a 5-row step at 2,048 keys over fp16 pages
     265-268 -> 166-174 us a layer, fp32 322-329 -> 191-197 (benchmarks/cpu_attention.py --threads 2, against
     c477b7f's one query head per tile; docs/benchmarks.md, "Fourteenth session"). A decode row over
     dense pages takes the pairs too (PAIRED_DECODE). AVX2 builds, where each element widens in two instructions:
     one row at 256 keys over fp16 pages 77.5 -> 58.8 us a layer on one thread, 62.0 -> 45.3 on two, 8 requests
     414 -> 184 on two (docs/benchmarks.md, "Thirty-fourth session"). AVX-512 builds kept one query head per tile
     (9 tiles share better among 2 threads than 3) and take the pairs where the step runs on one thread or has at
     least two KV heads a thread: one layer's call at 256 / 2,048 keys 1.34x / 1.54x on one thread, 8 requests
     1.48x on two, but one request's decode step over 30 layers on two threads 0.91-0.96x at 1,340 and 2,632
     tokens ("Thirty-sixth session"). A prompt R consecutive
     rows in one query head, or in AVX2 builds groups of up to GROUP_PAIRS (row, query head) pairs of one KV group
     (attend_group: a 64-row chunk of a prompt at 1,024 / 2,048 keys over fp16 pages 1.01-1.18x / 1.07-1.26x
     faster on one thread; docs/benchmarks.md, "Thirty-fifth session"). The threads take contiguous runs of tiles (each
     core then reads its own KV heads' pages: handing tiles out one at a time made a decode step at 1,340 tokens
     ~20% slower), except where a prompt is in the step: its later rows see more keys, so tiles go round-robin
     (a 2,632-token prefill over fp16 pages 4,204-4,334 ms against 4,914-5,000 in contiguous runs: cpu_kv_formats.py,
     docs/benchmarks.md). */
  long keys = 0;
  for (int b = 0; b < p->batch; b++) keys += (long)p->q_lens[b] * p->ctx_lens[b];
  const int team = threads > 1 && keys * H >= PARALLEL_KEYS ? threads : 1;
  const int R = tile_rows(D), paired = !KV_DENSE(p->k_type) || PAIRED_DECODE == 2 ||
                                       (PAIRED_DECODE == 1 && (team == 1 || p->batch * KVH >= 2 * team));
  const int GP = group_pairs(D); /* prompts (DEQUANTIZE_ROWS rows or more): groups of up to GP pairs */
  int tiles = 0, longest = 1;
  int prompt = 0;
  for (int b = 0; b < p->batch; b++) {
    const int m = p->q_lens[b];
    prompt |= m >= DEQUANTIZE_ROWS;
    if (GP > 0 && m >= DEQUANTIZE_ROWS)
      tiles += KVH * ((m * G + group_size(m * G, GP) - 1) / group_size(m * G, GP));
    else
      tiles += (paired || m > 1) && m < DEQUANTIZE_ROWS ? KVH * ((m * G + R - 1) / R) : (m + R - 1) / R * H;
    longest = p->ctx_lens[b] > longest ? p->ctx_lens[b] : longest;
  }
  Tile* work = malloc((size_t)tiles * sizeof(Tile));
  if (work == NULL) return -1;
  Tile* w = work;
  for (int b = 0; b < p->batch; b++) {
    const int m = p->q_lens[b];
    if (GP > 0 && m >= DEQUANTIZE_ROWS) { /* groups of about equal size, a multiple of 4, each KV head's in turn */
      const int pairs = m * G, size = group_size(pairs, GP);
      for (int i = 0; i < pairs; i += size)
        for (int h = 0; h < KVH; h++) *w++ = (Tile){b, i, pairs - i < size ? pairs - i : size, h, 2};
    } else if ((paired || m > 1) && m < DEQUANTIZE_ROWS)
      for (int h = 0; h < KVH; h++)
        for (int i = 0; i < m * G; i += R) *w++ = (Tile){b, i, m * G - i < R ? m * G - i : R, h, 1};
    else
      for (int i = 0; i < m; i += R)
        for (int hq = 0; hq < H; hq++) *w++ = (Tile){b, i, m - i < R ? m - i : R, hq, 0};
  }
  /* a row of scores per pair; one cache line more than whole lines, so that a group's rows do not all fall in the
     same L1 set (rows 8 KB apart would: its sets hold 8 lines) */
  const long s_row = (longest + 15) / 16 * 16 + 16;
  const int chunk = prompt ? 1 : (tiles + team - 1) / team;
  /* the dense copies (DEQUANTIZE_ROWS): request b's page j at scratch page first_page[b] + j, so its tiles read
     them through the identity table as dense pages (`dense`: binary16 where every value fits, else float32), the
     same values and so the same bits */
  const int ps = p->page_size;
  long* first_page = NULL;
  char* scratch = NULL;
  int32_t* identity = NULL;
  long copied = 0, widest = 0; /* pages copied per KV head; the most of one request */
  if (!KV_DENSE(p->k_type)) {
    for (int b = 0; b < p->batch; b++)
      if (p->q_lens[b] >= DEQUANTIZE_ROWS) {
        const long pages = (p->ctx_lens[b] + ps - 1) / ps;
        copied += pages;
        widest = pages > widest ? pages : widest;
      }
    const size_t bytes = (size_t)copied * KVH * ps * D * 2 * sizeof(float);
    if (copied > 0 && bytes <= MAX_DEQUANTIZED_BYTES) {
      first_page = malloc((size_t)p->batch * sizeof(long));
      identity = malloc((size_t)widest * sizeof(int32_t));
      scratch = first_page && identity ? (char*)scratch_of(&dequantized, bytes) : NULL;
      if (scratch == NULL) {
        free(first_page), free(identity);
        first_page = NULL, identity = NULL;
      }
    }
  }
  if (scratch != NULL) {
    for (long j = 0; j < widest; j++) identity[j] = (int32_t)j;
    for (int b = 0, next = 0; b < p->batch; b++) {
      const int copies = p->q_lens[b] >= DEQUANTIZE_ROWS;
      first_page[b] = copies ? next : -1;
      next += copies ? (p->ctx_lens[b] + ps - 1) / ps : 0;
    }
  }
  int half = scratch != NULL;
  for (int b = 0; half && b < p->batch; b++)
    half = first_page[b] < 0 || context_fits_half(p, b, k_scales, v_scales);
  const long units = scratch != NULL ? copied * KVH : 0; /* (KV head, page) to decode */
  const size_t head_bytes_copied = (size_t)copied * ps * D * (half ? 2 : 4); /* one KV head's keys (or values) */
  Plan dense = *p;
  dense.k_type = dense.v_type = half ? KV_F16 : KV_F32;
  int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(team) reduction(| : failed)
#endif
  {
    float* s = malloc((size_t)(GP > R ? GP : R) * s_row * sizeof(float));
    const size_t block_floats = (size_t)(KEY_BLOCK + ps - 1) / ps * ps * D;
    float* buf = GP > 0 ? aligned_alloc(32, block_floats * sizeof(float)) : NULL;
    failed = s == NULL || (GP > 0 && buf == NULL);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (long x = 0; x < units; x++) {
      const int h = (int)(x / copied);
      const long page = x % copied;
      int b = 0;
      while (first_page[b] < 0 || page >= first_page[b] + (p->ctx_lens[b] + ps - 1) / ps) b++;
      const int j0 = (int)(page - first_page[b]) * ps, len = p->ctx_lens[b] - j0 < ps ? p->ctx_lens[b] - j0 : ps;
      const size_t at = page_at(p, p->tables + (size_t)b * p->table_width, j0);
      const size_t dst = (size_t)page * ps * D * (half ? 2 : 4);
      const Pages kp = {(const char*)k_pages + h * k_head, k_scales + h * scale_head};
      const Pages vp = {(const char*)v_pages + h * v_head, v_scales + h * scale_head};
      dequantize_span(kp, at, len * D, p->k_type, scratch + 2 * h * head_bytes_copied + dst, half);
      dequantize_span(vp, at, len * D, p->v_type, scratch + (2 * h + 1) * head_bytes_copied + dst, half);
    }
#ifdef _OPENMP
#pragma omp for schedule(static, chunk)
#endif
    for (long x = 0; x < tiles; x++) {
      if (failed) continue;
      const Tile* tile = work + x;
      const int b = tile->b, m = p->q_lens[b], h = tile->pairs ? tile->head : tile->head / G;
      int ns[GROUP_PAIRS];
      const float* qs[GROUP_PAIRS];
      float* outs[GROUP_PAIRS];
      for (int r = 0; r < tile->count; r++) {
        const int k = tile->first + r, i = tile->pairs ? k / G : k, hq = tile->pairs ? h * G + k % G : tile->head;
        const size_t t = (size_t)(p->q_starts[b] + i);
        ns[r] = p->ctx_lens[b] - m + i + 1; /* row i sees its context up to itself */
        qs[r] = q + t * q_stride + (size_t)hq * D;
        outs[r] = out + (t * H + hq) * D;
      }
      Pages kp = {(const char*)k_pages + h * k_head, k_scales ? k_scales + h * scale_head : NULL};
      Pages vp = {(const char*)v_pages + h * v_head, v_scales ? v_scales + h * scale_head : NULL};
      const Plan* plan = p;
      const int32_t* table = p->tables + (size_t)b * p->table_width;
      if (scratch != NULL && first_page[b] >= 0) { /* its context as dense pages, decoded above */
        const size_t from = (size_t)first_page[b] * ps * D * (half ? 2 : 4);
        kp = (Pages){scratch + 2 * h * head_bytes_copied + from, NULL};
        vp = (Pages){scratch + (2 * h + 1) * head_bytes_copied + from, NULL};
        plan = &dense;
        table = identity;
      }
#ifdef HAVE_GROUP
      if (tile->pairs == 2)
        attend_pairs(plan, table, tile->count, ns, qs, kp, vp, s, s_row, outs, buf);
      else
#endif
        attend_rows(plan, table, tile->count, ns, qs, kp, vp, s, s_row, outs);
      if (r_out) /* back from the pages' basis */
        for (int r = 0; r < tile->count; r++) {
          float y[256];
          hadamard_row(D, r_out, rot->scale, outs[r], y);
          memcpy(outs[r], y, (size_t)D * sizeof(float));
        }
    }
    free(s);
    free(buf);
  }
  free(work);
  free(first_page);
  free(identity);
  return failed ? -1 : 0;
}
"""
# the attention's kernels alone (each KV format's functions and what they inline), which kernels/cpu_block.py
# compiles as a translation unit of their own beside the rest of the library
C_KERNELS = C_SOURCE[: C_SOURCE.index("/* ---- end of the kernels")]


class Plan(ctypes.Structure):
    """The C kernel's view of one step (the `Plan` struct of C_SOURCE)."""

    _fields_ = [
        *((name, ctypes.c_int) for name in ("batch", "heads", "kv_heads", "head_dim", "page_size")),
        ("table_width", ctypes.c_int),
        ("tokens", ctypes.c_int),
        ("k_type", ctypes.c_int),
        ("v_type", ctypes.c_int),
        ("num_slots", ctypes.c_long),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("tables", "q_starts", "q_lens", "ctx_lens", "slots")),
    ]


class Rotation(ctypes.Structure):
    """How quantized pages hold a layer's rows (the `Rotation` struct of C_SOURCE): see `PageRotation`."""

    _fields_ = [
        ("q_mat", ctypes.c_void_p),
        ("q_head", ctypes.c_long),
        ("k_mat", ctypes.c_void_p),
        ("k_head", ctypes.c_long),
        ("hadamard", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("rule", ctypes.c_int),
    ]


class PageRotation:
    """How quantized pages hold a layer's rows (engine/kv_pages.py's rotation and key transform), and the MXFP4
    scale rule: `hadamard` = R's block (the block-diagonal Sylvester-Hadamard matrix kv_pages.rotation_matrix
    makes, entries +-`scale`; 0: no rotation). Values are stored as v R, keys as k @ k_mat where a key transform
    gives one (A R), else k R; queries attend as q @ q_mat, else q R; the output is rotated by R on the way out.
    q_mat and k_mat: [KVH, D, D] (a query head takes its KV head's) or [D, D] or None. R is applied by
    butterflies (`hadamard_rows_ref`), the matrices as ordered sums (`rotate_rows_ref`). Built once a layer
    (kv_pages.PageStore.cpu_rotation)."""

    def __init__(
        self, q_mat: torch.Tensor | None, k_mat: torch.Tensor | None, hadamard: int, scale: float, rule: str
    ) -> None:
        self.mats = tuple(None if m is None else m.float().contiguous() for m in (q_mat, k_mat))
        self.hadamard, self.scale, self.rule = hadamard, scale, rule
        head = [0 if m is None or m.dim() == 2 else m.shape[-1] ** 2 for m in self.mats]
        ptrs = [None if m is None else m.data_ptr() for m in self.mats]
        rule_id = mxfp4.RULES.index(rule)
        self.struct = Rotation(ptrs[0], head[0], ptrs[1], head[1], hadamard, scale, rule_id)
        self.ref = ctypes.byref(self.struct)

    def rows_ref(self, x: torch.Tensor, mat: torch.Tensor | None) -> torch.Tensor:
        """x [..., D] into the pages' basis as the kernel computes it: mat where given, else R."""
        return rotate_rows_ref(x, mat) if mat is not None else hadamard_rows_ref(x, self.hadamard, self.scale)


@cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_build.load_part("cpu_attention", cpu_ops.C_SOURCE + C_SOURCE, cpu_ops.CFLAGS)
    if lib is None:
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_long
    lib.paged_attention.argtypes = [ctypes.POINTER(Plan), ptr, i64, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]
    lib.paged_attention.argtypes += [ctypes.POINTER(Rotation), ptr, ctypes.c_int]
    lib.paged_attention.restype = ctypes.c_int
    i32 = ctypes.c_int
    lib.quantize_rows.argtypes = [i32, i32, i32, i32, ptr, i64, ptr, i32, ctypes.c_float, ptr, ptr]
    lib.quantize_rows.restype = None
    return lib


def available() -> bool:
    """Whether the compiled kernel loads on this machine."""
    return _library() is not None


def supports(head_dim: int) -> bool:
    """Whether the kernel attends at this head_dim here (compiled, and a query row's output fits its registers)."""
    return head_dim <= MAX_HEAD_DIM and available()


class AttentionPlan:
    """One step's requests as the attention kernel reads them, built once per step and used by every layer:
    block tables [B, pages] int32, each request's first query row, new tokens and context length [B] int32,
    and the slots [T] int64 where the step's keys and values go."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        ctx_lens: torch.Tensor,
        slots: torch.Tensor,
        page_size: int,
        num_heads: int,
        kv_heads: int,
        head_dim: int,
        num_slots: int,
        scale: float,
        kv_dtype: torch.dtype = torch.float32,
        quantized: tuple[str, str] | None = None,
    ) -> None:
        """kv_dtype: the dense pages' element type; quantized: the element formats of the keys' and the values'
        pages where they are quantized instead ("mxfp8" or "mxfp4" each: kv_quant.PageTensor), read by
        `paged_attention_quantized`."""
        assert block_tables.dtype == q_starts.dtype == q_lens.dtype == ctx_lens.dtype == torch.int32
        assert slots.dtype == torch.int64 and slots.dim() == 1, (slots.dtype, slots.shape)
        assert num_heads % kv_heads == 0 and head_dim <= MAX_HEAD_DIM, (num_heads, kv_heads, head_dim)
        assert quantized is None or quantized in QUANTIZED_PAIRS, quantized
        self.tensors = tuple(t.contiguous() for t in (block_tables, q_starts, q_lens, ctx_lens, slots))
        batch = q_lens.shape[0]
        assert block_tables.shape[0] == q_starts.shape[0] == ctx_lens.shape[0] == batch, block_tables.shape
        assert bool((q_lens <= ctx_lens).all()), (q_lens, ctx_lens)
        assert int(q_lens.sum()) == slots.shape[0], (q_lens, slots.shape)
        self.num_heads, self.kv_heads, self.head_dim, self.num_slots = num_heads, kv_heads, head_dim, num_slots
        self.tokens = slots.shape[0]
        self.q_shape = (self.tokens, num_heads, head_dim)  # what each layer's call must match
        self.kv_shape = (self.tokens, kv_heads, head_dim)
        self.pages_shape = (kv_heads, num_slots, head_dim)
        self.kv_dtype = kv_dtype  # the dense pages' element type
        self.quantized = quantized
        self.struct = Plan(
            batch, num_heads, kv_heads, head_dim, page_size, block_tables.shape[1], self.tokens,
            *((QUANTIZED_TYPES[f] for f in quantized) if quantized else (KV_TYPES[kv_dtype],) * 2), num_slots, scale,
            *(t.data_ptr() for t in self.tensors),
        )  # fmt: skip
        self.ref = ctypes.byref(self.struct)


Pages = torch.Tensor | kv_quant.PageTensor  # dense pages [KVH, slots, D], or quantized ones


def page_pointers(plan: AttentionPlan, k_pages: Pages, v_pages: Pages, rotation: PageRotation | None) -> tuple:
    """The pages as the C calls take them, checked against the plan: (key elements, key scales, value elements,
    value scales, rotation); dense pages (tensors of the plan's kv_dtype) have no scales and no rotation,
    quantized ones (kv_quant.PageTensor of the plan's `quantized` formats) both."""
    if plan.quantized is None:
        for pages in (k_pages, v_pages):
            assert pages.shape == plan.pages_shape and pages.dtype == plan.kv_dtype and pages.is_contiguous()
        assert rotation is None, "dense pages hold rows as they are"
        return k_pages.data_ptr(), None, v_pages.data_ptr(), None, None
    assert plan.quantized == (k_pages.fmt, v_pages.fmt), (plan.quantized, k_pages.fmt, v_pages.fmt)
    assert k_pages.rule == v_pages.rule == rotation.rule, (k_pages.rule, v_pages.rule, rotation.rule)
    for pages in (k_pages, v_pages):
        assert pages.data.shape[:2] == plan.pages_shape[:2] and pages.data.is_contiguous()
        assert pages.scales.shape == (*plan.pages_shape[:2], plan.head_dim // 32) and pages.scales.is_contiguous()
    k_ptrs, v_ptrs = ((t.data.data_ptr(), t.scales.data_ptr()) for t in (k_pages, v_pages))
    return *k_ptrs, *v_ptrs, rotation.ref


def paged_attention(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    threads: int = 1,
) -> torch.Tensor:
    """Write k/v [T, KVH, D] (float32) into the dense pages [KVH, slots, D] of the plan's kv_dtype (float32, float16
    or bfloat16, rounded as torch converts, float16 saturating at +-65504: `to_pages`) at the plan's slots, then
    return [T, H, D]: each new row's causal attention over its request's context (q [T, H, D]), the same bits for
    any `threads`."""
    assert plan.quantized is None, "quantized pages: paged_attention_quantized"
    return _attend(plan, q, k, v, page_pointers(plan, k_pages, v_pages, None), threads)


def paged_attention_quantized(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: kv_quant.PageTensor,
    v_pages: kv_quant.PageTensor,
    rotation: PageRotation,
    threads: int = 1,
) -> torch.Tensor:
    """Quantized pages (kv_quant.PageTensor of the plan's `quantized` formats): this step's k/v [T, KVH, D]
    (float32, as the model computed them) multiplied by the rotation's matrices and quantized into their slots as
    kv_quant.quantize_rows quantizes (bit for bit: `quantize_rows`), then [T, H, D]: each new row's causal attention
    (q [T, H, D] float32, rotated alike) over its request's context, each element read as its code's value times its
    block's scale (the float32 kv_quant's dequantization gives) with the dense kernel's arithmetic, rotated back:
    a row's bits do not depend on what else the step holds."""
    assert plan.quantized is not None, "dense pages: paged_attention"
    return _attend(plan, q, k, v, page_pointers(plan, k_pages, v_pages, rotation), threads)


def _attend(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: tuple, threads: int):
    """The C call: this step's rows (stored into the pages) and `page_pointers`."""
    q_stride = cpu_ops.heads_view(q, plan.q_shape)
    k_stride, v_stride = cpu_ops.heads_view(k, plan.kv_shape), cpu_ops.heads_view(v, plan.kv_shape)
    out = torch.empty(*plan.q_shape)
    status = _library().paged_attention(
        plan.ref, q.data_ptr(), q_stride, k.data_ptr(), k_stride, v.data_ptr(), v_stride, *pages, out.data_ptr(),
        threads,
    )  # fmt: skip
    if status != 0:
        raise MemoryError("cpu_attention.paged_attention: no memory for a row of scores")
    return out


def quantize_rows(
    x: torch.Tensor, fmt: str, rule: str, mat: torch.Tensor | None = None, hadamard: int = 0, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [n, D] (float32) rotated as the kernel rotates a key (mat [D, D], `rotate_rows_ref`; else R in blocks
    of `hadamard` times `scale`, `hadamard_rows_ref`; 0: as they are) and quantized as it stores them: (codes,
    scales) of kv_quant.quantize_rows(rotated, fmt, rule), which tests hold equal bit for bit."""
    n, d = x.shape
    assert x.dtype == torch.float32 and x.stride(1) == 1 and d % 32 == 0, (x.dtype, x.shape)
    codes = torch.empty(n, kv_quant.code_bytes(fmt, d), dtype=torch.uint8)
    scales = torch.empty(n, d // 32, dtype=torch.uint8)
    m = None if mat is None else mat.float().contiguous()
    _library().quantize_rows(
        n, d, QUANTIZED_TYPES[fmt], mxfp4.RULES.index(rule), x.data_ptr(), x.stride(0),
        None if m is None else m.data_ptr(), hadamard, scale, codes.data_ptr(), scales.data_ptr(),
    )  # fmt: skip
    return codes, scales


def to_pages(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as the kernel stores them in dense pages of dtype: torch's rounding, float16 saturating at +-65504."""
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def rotate_rows_ref(x: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    """x [..., D] @ mat, summed as the kernel sums it: x[..., 0] mat[0] + x[..., 1] mat[1] + ... in that order, float32
    products and sums (bit for bit). mat [D, D], or [..., D, D] broadcast against x's heads."""
    y = x[..., 0:1] * mat[..., 0, :]
    for d in range(1, x.shape[-1]):
        y = y + x[..., d : d + 1] * mat[..., d, :]
    return y


def hadamard_rows_ref(x: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """x [..., D] @ R (the block-diagonal Sylvester-Hadamard matrix, blocks of `block`, entries +-scale) by the
    kernel's butterflies, bit for bit: in each block, for h = 1, 2, ..., block / 2, every pair (j, j + h) of a group
    of 2h becomes (a + b, a - b); then times the scale. block 0: x."""
    if block == 0:
        return x
    shape = x.shape
    y = x.reshape(*shape[:-1], shape[-1] // block, block)
    h = 1
    while h < block:
        pairs = y.unflatten(-1, (block // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * torch.tensor(scale, dtype=torch.float32)).reshape(shape)


def paged_attention_quantized_ref(
    plan: AttentionPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: kv_quant.PageTensor,
    v_pages: kv_quant.PageTensor,
    rotation: PageRotation,
    threads: int = 1,
) -> torch.Tensor:
    """paged_attention_quantized in torch: rotate (`rotate_rows_ref`), quantize into the pages with kv_quant, then
    attend over the dequantized pages and rotate back."""
    q_mat, k_mat = rotation.mats
    group = plan.num_heads // plan.kv_heads
    slots = plan.tensors[4]
    k_pages.write(slots, rotation.rows_ref(k, k_mat).contiguous())
    v_pages.write(slots, rotation.rows_ref(v, None).contiguous())
    if q_mat is not None and q_mat.dim() == 3:
        q_mat = q_mat.repeat_interleave(group, 0)  # [H, D, D]: each query head its KV head's
    keys, values = k_pages.read(slice(None), torch.float32), v_pages.read(slice(None), torch.float32)
    out = _attend_ref(plan, rotation.rows_ref(q, q_mat), keys, values)
    return rotation.rows_ref(out, None)


def _attend_ref(plan: AttentionPlan, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
    """Per request, gather its context from the pages [KVH, slots, D] and attend (every row causal)."""
    tables, starts, q_lens, ctx_lens, _ = plan.tensors
    page_size = plan.struct.page_size
    out = torch.empty(q.shape)
    group = plan.num_heads // plan.kv_heads
    for b in range(q_lens.shape[0]):
        n, c, start = int(q_lens[b]), int(ctx_lens[b]), int(starts[b])
        pos = torch.arange(c)
        ctx = tables[b].long()[pos // page_size] * page_size + pos % page_size
        keys = k_pages[:, ctx].float().repeat_interleave(group, 0)  # [H, c, D]
        values = v_pages[:, ctx].float().repeat_interleave(group, 0)
        scores = torch.einsum("thd,hcd->htc", q[start : start + n], keys) * plan.struct.scale  # [H, n, c]
        seen = pos[None, :] <= (c - n + torch.arange(n))[:, None]  # [n, c]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[start : start + n] = torch.einsum("htc,hcd->thd", probs, values)
    return out


def paged_attention_ref(
    plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor
) -> torch.Tensor:
    """The same by indexing: store k/v at the slots, then per request gather its context and attend."""
    slots = plan.tensors[4]
    k_pages[:, slots] = to_pages(k.transpose(0, 1), k_pages.dtype)
    v_pages[:, slots] = to_pages(v.transpose(0, 1), v_pages.dtype)
    return _attend_ref(plan, q, k_pages, v_pages)
