"""Block-quantized matrix products on the CPU with int8 activations: GGUF Q4_1 / Q8_0 weights, AVX512-VNNI or AVX2.

kernels/cpu_gemv.py dequantizes each weight block to float32 and does one float FMA per weight and activation row,
so a 5-row verification step costs ~2x a 1-row decode step on a 2-core CPU. Here, as llama.cpp does, each
activation row is quantized per block of 32 to int8 with one float32 scale, and a block's dot product is integer:

    dx = max|x_j| / 127,  xq_j = round(x_j / dx)  (round half to even; xq_j in -127..127, all zero where dx = 0)
    Q4_1 (w_j = dw * q_j + mw, q_j in 0..15):  sum_j w_j x_j ~= (dw * dx) * sum_j q_j xq_j + mw * (dx * sum_j xq_j)
    Q8_0 (w_j = dw * q_j, q_j in -127..127):   sum_j w_j x_j ~= (dw * dx) * sum_j q_j xq_j

`_mm512_dpbusd_epi32` multiplies unsigned by signed bytes and adds each four products into a 32-bit lane: 64
products an instruction, against 16 for a float FMA. Q4_1 codes are unsigned already; Q8_0 codes are stored
offset by 128 (0..255) and the block's sum starts at -128 * sum_j xq_j, which makes it exactly sum_j q_j xq_j.

Layout: the weights are repacked once (`repack_q4` / `repack_q8`) so that a 32-bit lane is one output row: per
group of 16 output rows and block g, word v (4 consecutive bytes of the block, as GGUF stores them) of each of the
16 rows side by side in one 64-byte vector. A Q4_1 word holds q[4v..4v+3] in its low nibbles and q[4v+16..4v+19]
in its high nibbles (GGUF's layout), so one load and two masks give the lanes for two 4-byte activation words,
each broadcast to all lanes. The integer block sums come out one per output lane, with no horizontal reduction;
the scales are stored [group, block, 16] to match, as float16 (GGUF's own scale type, exact in float32; float32
scales made a Q4_1 weight 0.75 bytes, float16 0.625: the single-thread decode step reads its weights from DRAM).
Rows past N (a last partial group) are zero weights, not stored.

The float combination is fixed: per (row, output), over the blocks in order, acc += (dw * dx) * isum, then (Q4_1)
acc += mw * (dx * sum xq), each product and sum rounded once (no FMA contraction). The integer sums are exact, so
an output depends only on its own activation row, never on the batch, tile or thread (a verification step gives
plain decoding's logits bit for bit: lossless speculation stays exact), and `q4_linear_ref` / `q8_linear_ref`
below, the same math in plain torch, give the same bits. Without AVX512-VNNI and AVX512-BW at build time the
AVX2 build emulates dpbusd with maddubs + madd (the same integers, so the same bits; 2.4x the float AVX2 kernels
per token on an AMD EPYC, docs/benchmarks.md); without either, `available()` is False and callers keep float
activations (kernels/cpu_gemv.py).
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from specchat.kernels import cpu_build, cpu_gemv

BLOCK = cpu_gemv.BLOCK  # weights per quantization block (GGUF Q4_1 / Q8_0), and activations per int8 scale
GROUP = 16  # output rows interleaved in one vector: one 32-bit lane each
Q4_WORDS, Q8_WORDS = 4, 8  # 4-byte words per block and output row: 16 bytes of nibbles, 32 bytes of int8 codes
Q8_OFFSET = 128  # added to the signed Q8_0 codes so they are dpbusd's unsigned operand

C_SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#define I8_MMAX 8  /* activation rows a tile keeps in registers */
/* Bytes ahead of each weight load to prefetch: the head (28 MB on the default model) streams from L3 ~1.5x
   faster with it (benchmarks/cpu_gemv.py; 512-4096 measured, 1024 best). */
#define I8_PF 1024

/* Activation rows quantized per block of 32: q [M, K] int8, d [M, G] scale, s [M, G] = d * sum(q) (Q4_1's
   offset term), sum [M, G] = sum(q) (Q8_0's correction of the +128 codes). */
typedef struct {
  int8_t* q;
  float* d;
  float* s;
  int32_t* sum;
} Acts;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define I8_INLINE static inline __attribute__((always_inline))

#define I8_OK 1

/* dx = amax / 127, xq = round-half-even(x * (1 / dx)) (cvtps_epi32 under the default rounding mode), 0 where
   amax = 0; |x * (1 / dx)| <= 127 up to one rounding, so the saturating pack to int8 never clips. */
void i8_quantize_rows(int M, int K, const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  const int G = K / 32;
  for (size_t b = 0; b < (size_t)M * G; b++) {
    const __m512 lo = _mm512_loadu_ps(x + b * 32), hi = _mm512_loadu_ps(x + b * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i*)(q + b * 32), _mm512_cvtsepi32_epi8(ql));
    _mm_storeu_si128((__m128i*)(q + b * 32 + 16), _mm512_cvtsepi32_epi8(qh));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
    d[b] = db;
    sum[b] = total;
    s[b] = db * (float)total;
  }
}

/* 16 float16 scales -> float32 (exact: every float16 is a float32). */
I8_INLINE __m512 load_half16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

I8_INLINE __m512i broadcast_word(const int8_t* p) {
  int32_t word;
  memcpy(&word, p, 4);
  return _mm512_set1_epi32(word);
}

/* acc (one lane per output of group r) += (d * dx) * isum [+ m * (dx * sum xq)], in that order for every tile. */
I8_INLINE __m512 combine(__m512 acc, __m512i isum, __m512 dg, float dx) {
  return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_mul_ps(dg, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(isum)));
}

I8_INLINE void store_groups(const int R, const int NR, int N, __m512 acc[][4], float* y, int grp) {
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++) {
      const int n = (grp + r) * 16, left = N - n;
      const __mmask16 keep = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
      _mm512_mask_storeu_ps(y + (size_t)i * N + n, keep, acc[i][r]);
    }
}

/* One tile: R activation rows times NR groups of 16 outputs from group grp (compile-time R and NR at each call,
   so the accumulators live in registers). Two integer chains per (row, group), low and high nibbles, to hide
   dpbusd's latency; their sum is exact. */
I8_INLINE void q4i8_tile(const int R, const int NR, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d,
                         const uint16_t* m, float* y, int grp) {
  const int G = K / 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[I8_MMAX][4];
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m512i lo_sum[I8_MMAX][4], hi_sum[I8_MMAX][4];
    for (int i = 0; i < R; i++)
      for (int r = 0; r < NR; r++) lo_sum[i][r] = hi_sum[i][r] = _mm512_setzero_si512();
    for (int v = 0; v < 4; v++)
      for (int r = 0; r < NR; r++) {
        const uint8_t* b = w + (((size_t)(grp + r) * G + g) * 4 + v) * 64;
        _mm_prefetch((const char*)(b + I8_PF), _MM_HINT_T0);
        const __m512i packed = _mm512_loadu_si512(b);
        const __m512i wl = _mm512_and_si512(packed, nibble);
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        for (int i = 0; i < R; i++) {
          const int8_t* xq = a->q + (size_t)i * K + g * 32 + 4 * v;
          lo_sum[i][r] = _mm512_dpbusd_epi32(lo_sum[i][r], wl, broadcast_word(xq));
          hi_sum[i][r] = _mm512_dpbusd_epi32(hi_sum[i][r], wh, broadcast_word(xq + 16));
        }
      }
    for (int r = 0; r < NR; r++) {
      const size_t at = ((size_t)(grp + r) * G + g) * 16;
      const __m512 dg = load_half16(d + at), mg = load_half16(m + at);
      for (int i = 0; i < R; i++) {
        acc[i][r] = combine(acc[i][r], _mm512_add_epi32(lo_sum[i][r], hi_sum[i][r]), dg, a->d[(size_t)i * G + g]);
        acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_mul_ps(mg, _mm512_set1_ps(a->s[(size_t)i * G + g])));
      }
    }
  }
  store_groups(R, NR, N, acc, y, grp);
}

I8_INLINE void q8i8_tile(const int R, const int NR, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d,
                         float* y, int grp) {
  const int G = K / 32;
  __m512 acc[I8_MMAX][4];
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m512i even[I8_MMAX][4], odd[I8_MMAX][4];
    for (int i = 0; i < R; i++)
      for (int r = 0; r < NR; r++) {
        even[i][r] = _mm512_set1_epi32(-128 * a->sum[(size_t)i * G + g]);
        odd[i][r] = _mm512_setzero_si512();
      }
    for (int v = 0; v < 8; v += 2)
      for (int r = 0; r < NR; r++) {
        const uint8_t* b = w + (((size_t)(grp + r) * G + g) * 8 + v) * 64;
        _mm_prefetch((const char*)(b + I8_PF), _MM_HINT_T0);
        _mm_prefetch((const char*)(b + I8_PF + 64), _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(b), w1 = _mm512_loadu_si512(b + 64);
        for (int i = 0; i < R; i++) {
          const int8_t* xq = a->q + (size_t)i * K + g * 32 + 4 * v;
          even[i][r] = _mm512_dpbusd_epi32(even[i][r], w0, broadcast_word(xq));
          odd[i][r] = _mm512_dpbusd_epi32(odd[i][r], w1, broadcast_word(xq + 4));
        }
      }
    for (int r = 0; r < NR; r++) {
      const __m512 dg = load_half16(d + ((size_t)(grp + r) * G + g) * 16);
      for (int i = 0; i < R; i++)
        acc[i][r] = combine(acc[i][r], _mm512_add_epi32(even[i][r], odd[i][r]), dg, a->d[(size_t)i * G + g]);
    }
  }
  store_groups(R, NR, N, acc, y, grp);
}

/* Groups g0 <= group < g1 for `rows` activation rows: NR groups at a time, then the rest one at a time. The tile
   shape changes the speed, never the values. */
#define I8_TILES(TILE, R, NR, ...)                                             \
  do {                                                                         \
    int grp = g0;                                                              \
    for (; grp + NR <= g1; grp += NR) TILE(R, NR, N, K, a, __VA_ARGS__, y, grp); \
    for (; grp < g1; grp++) TILE(R, 1, N, K, a, __VA_ARGS__, y, grp);          \
  } while (0)
#define I8_DISPATCH(TILE, ...)                                                 \
  switch (rows) {                                                              \
    case 1: I8_TILES(TILE, 1, 4, __VA_ARGS__); break;                          \
    case 2: I8_TILES(TILE, 2, 2, __VA_ARGS__); break;                          \
    case 3: I8_TILES(TILE, 3, 2, __VA_ARGS__); break;                          \
    case 4: I8_TILES(TILE, 4, 1, __VA_ARGS__); break;                          \
    case 5: I8_TILES(TILE, 5, 1, __VA_ARGS__); break;                          \
    case 6: I8_TILES(TILE, 6, 1, __VA_ARGS__); break;                          \
    case 7: I8_TILES(TILE, 7, 1, __VA_ARGS__); break;                          \
    default: I8_TILES(TILE, 8, 1, __VA_ARGS__); break;                         \
  }

static void q4i8_chunk(int rows, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                       float* y, int g0, int g1) {
  I8_DISPATCH(q4i8_tile, w, d, m)
}

static void q8i8_chunk(int rows, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d, float* y, int g0,
                       int g1) {
  I8_DISPATCH(q8i8_tile, w, d)
}

static void i8_chunk(int rows, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                     float* y, int g0, int g1) {
  if (m != NULL)
    q4i8_chunk(rows, N, K, a, w, d, m, y, g0, g1);
  else
    q8i8_chunk(rows, N, K, a, w, d, y, g0, g1);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define I8_INLINE static inline __attribute__((always_inline))
#define I8_OK 1
#define I8_RMAX2 5 /* rows per AVX2 tile: a k = 4 verification's in one pass */

/* AVX2: the same integers and the same float combination as the AVX-512 tiles, so the same bits. dpbusd is
   maddubs (unsigned x signed bytes, pairs summed to 16 bits) then madd with ones (pairs summed to 32 bits): Q4_1
   codes are 0..15, so no pair saturates; Q8_0's stored codes (offset by 128) are turned back into signed ones,
   whose magnitudes (at most 128) multiply the activations with the codes' signs applied to them (llama.cpp's
   trick): 2 x 128 x 127 fits. A group's 16 output lanes are two 8-lane halves of its 64-byte vectors. */

/* The AVX-512 quantization's math: dx = amax / 127, xq = round-half-even(x * (1 / dx)), 0 where amax = 0. */
void i8_quantize_rows(int M, int K, const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  const int G = K / 32;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (size_t b = 0; b < (size_t)M * G; b++) {
    __m256 v[4], mx;
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + b * 32 + 8 * j);
    mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                       _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t qi[32];
    for (int j = 0; j < 4; j++)
      _mm256_storeu_si256((__m256i*)(qi + 8 * j), _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv))));
    int32_t total = 0;
    for (int j = 0; j < 32; j++) {
      q[b * 32 + j] = (int8_t)qi[j];
      total += qi[j];
    }
    d[b] = db;
    sum[b] = total;
    s[b] = db * (float)total;
  }
}

I8_INLINE __m256 load_half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

I8_INLINE __m256i word8(const int8_t* p) {
  int32_t word;
  memcpy(&word, p, 4);
  return _mm256_set1_epi32(word);
}

/* acc += (d * dx) * isum, the AVX-512 tiles' `combine`. */
I8_INLINE __m256 combine8(__m256 acc, __m256i isum, __m256 dg, float dx) {
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(dg, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(isum)));
}

I8_INLINE void store8(const int R, int N, __m256 acc[], float* y, int n) {
  const int left = N - n;
  for (int i = 0; i < R; i++) {
    if (left >= 8) {
      _mm256_storeu_ps(y + (size_t)i * N + n, acc[i]);
    } else {
      float lanes[8];
      _mm256_storeu_ps(lanes, acc[i]);
      for (int j = 0; j < left; j++) y[(size_t)i * N + n + j] = lanes[j];
    }
  }
}

/* R rows (at most I8_RMAX2) times the 8 outputs of half h of group grp. A block's integer sums per row: Q4_1's
   maddubs pairs (at most 2 x 15 x 127) add up in 16-bit lanes, eight of them at most 30,480, and become 32-bit
   once per block (one madd); Q8_0's (at most 2 x 128 x 127) are widened at once. The same integers as dpbusd. */
I8_INLINE void i8_half(const int Q4, const int R, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d,
                       const uint16_t* m, float* y, int grp, int h) {
  const int G = K / 32, words = Q4 ? 4 : 8;
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  __m256 acc[I8_RMAX2];
  for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m256i sum[I8_RMAX2];
    for (int i = 0; i < R; i++) sum[i] = _mm256_setzero_si256();
    const uint8_t* blk = w + ((size_t)grp * G + g) * words * 64 + 32 * h;
    for (int v = 0; v < words; v++) {
      /* Every 64-byte line ahead, as the AVX-512 tiles do, in the first half's pass (the second reads the same
         lines from L1). One line a block left the head's stream to the hardware prefetcher: 1.7x slower at one
         row on an AMD EPYC (docs/benchmarks.md, thirty-third session). */
      if (h == 0) _mm_prefetch((const char*)(blk + (size_t)v * 64 + I8_PF), _MM_HINT_T0);
      const __m256i packed = _mm256_loadu_si256((const __m256i*)(blk + (size_t)v * 64));
      if (Q4) {
        const __m256i wl = _mm256_and_si256(packed, nibble);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        for (int i = 0; i < R; i++) {
          const int8_t* xq = a->q + (size_t)i * K + g * 32 + 4 * v;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(wl, word8(xq)),
                                                 _mm256_maddubs_epi16(wh, word8(xq + 16)));
          sum[i] = _mm256_add_epi16(sum[i], pairs);
        }
      } else {
        const __m256i ws = _mm256_xor_si256(packed, flip); /* the signed code */
        const __m256i mag = _mm256_abs_epi8(ws);
        for (int i = 0; i < R; i++) {
          const __m256i xs = _mm256_sign_epi8(word8(a->q + (size_t)i * K + g * 32 + 4 * v), ws);
          sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), ones));
        }
      }
    }
    const size_t at = ((size_t)grp * G + g) * 16 + 8 * h;
    const __m256 dg = load_half8(d + at), mg = Q4 ? load_half8(m + at) : _mm256_setzero_ps();
    for (int i = 0; i < R; i++) {
      const __m256i isum = Q4 ? _mm256_madd_epi16(sum[i], ones) : sum[i];
      acc[i] = combine8(acc[i], isum, dg, a->d[(size_t)i * G + g]);
      if (Q4) acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(mg, _mm256_set1_ps(a->s[(size_t)i * G + g])));
    }
  }
  store8(R, N, acc, y, grp * 16 + 8 * h);
}

I8_INLINE void i8_rows2(const int Q4, int rows, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d,
                        const uint16_t* m, float* y, int g0, int g1) {
  for (int i0 = 0; i0 < rows; i0 += I8_RMAX2) {
    const int G = K / 32, r = rows - i0 < I8_RMAX2 ? rows - i0 : I8_RMAX2;
    const Acts sub = {a->q + (size_t)i0 * K, a->d + (size_t)i0 * G, a->s + (size_t)i0 * G, a->sum + (size_t)i0 * G};
    float* yi = y + (size_t)i0 * N;
    for (int grp = g0; grp < g1; grp++)
      for (int h = 0; h < 2; h++) {
        if (grp * 16 + 8 * h >= N) break;
        switch (r) {
          case 1: i8_half(Q4, 1, N, K, &sub, w, d, m, yi, grp, h); break;
          case 2: i8_half(Q4, 2, N, K, &sub, w, d, m, yi, grp, h); break;
          case 3: i8_half(Q4, 3, N, K, &sub, w, d, m, yi, grp, h); break;
          case 4: i8_half(Q4, 4, N, K, &sub, w, d, m, yi, grp, h); break;
          default: i8_half(Q4, 5, N, K, &sub, w, d, m, yi, grp, h); break;
        }
      }
  }
}

static void i8_chunk(int rows, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                     float* y, int g0, int g1) {
  if (m != NULL)
    i8_rows2(1, rows, N, K, a, w, d, m, y, g0, g1);
  else
    i8_rows2(0, rows, N, K, a, w, d, m, y, g0, g1);
}
#endif

#ifdef I8_OK
int i8_has_vnni(void) { return 1; }

/* Groups g0 .. g1 - 1 of 16 outputs of all M rows (quantized: `all`), I8_MMAX rows at a time. */
static void i8_rows(int M, int N, int K, const Acts* all, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                    float* y, int g0, int g1) {
  const int G = K / 32;
  for (int i0 = 0; i0 < M; i0 += I8_MMAX) {
    const int rows = M - i0 < I8_MMAX ? M - i0 : I8_MMAX;
    const size_t at = (size_t)i0 * G;
    const Acts a = {all->q + (size_t)i0 * K, all->d + at, all->s + at, all->sum + at};
    i8_chunk(rows, N, K, &a, w, d, m, y + (size_t)i0 * N, g0, g1);
  }
}

/* y [M, N] = x [M, K] W^T for repacked Q4_1 (m != NULL) or Q8_0 (m == NULL) weights: the rows quantized once,
   then I8_MMAX rows at a time, `threads` > 1 splitting the groups of 16 outputs, each thread taking its groups of
   every row chunk in one OpenMP region (a region per chunk, 256 for a 2,048-row prompt, made each thread wait for
   the other 256 times a linear: with a third busy process on 2 cores a 2,048-token prefill took 42 s against 16;
   docs/benchmarks.md, thirty-fifth session). Returns 0, or -1 without memory for the quantized rows. */
#define I8_PARALLEL_QUANTIZE 32 /* rows from which the threads quantize them too (a prompt's: 2.7% of a 2,048-token
                                   prefill on one thread; a decode step's stay on the caller, without a barrier) */
int i8_gemm(int M, int N, int K, const float* x, const uint8_t* w, const uint16_t* d, const uint16_t* m, float* y,
            int threads) {
  const int G = K / 32, groups = (N + 15) / 16;
  const size_t mg = (size_t)M * G;
  char* scratch = malloc((size_t)M * K + mg * (2 * sizeof(float) + sizeof(int32_t)));
  if (scratch == NULL) return -1;
  float* dx = (float*)(scratch + (size_t)M * K);
  Acts all = {(int8_t*)scratch, dx, dx + mg, (int32_t*)(dx + 2 * mg)};
#ifdef _OPENMP
  if (threads > 1 && M >= I8_PARALLEL_QUANTIZE) {
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
      for (int t = 0; t < threads; t++) {
        const size_t r0 = (size_t)M * t / threads, r1 = (size_t)M * (t + 1) / threads;
        i8_quantize_rows((int)(r1 - r0), K, x + r0 * K, all.q + r0 * K, all.d + r0 * G, all.s + r0 * G,
                         all.sum + r0 * G);
      } /* (the loop's barrier: every row quantized before any is read) */
#pragma omp for schedule(static)
      for (int t = 0; t < threads; t++)
        i8_rows(M, N, K, &all, w, d, m, y, (int)((long)groups * t / threads),
                (int)((long)groups * (t + 1) / threads));
    }
    free(scratch);
    return 0;
  }
#endif
  i8_quantize_rows(M, K, x, all.q, all.d, all.s, all.sum);
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++)
      i8_rows(M, N, K, &all, w, d, m, y, (int)((long)groups * t / threads),
              (int)((long)groups * (t + 1) / threads));
  } else
#endif
    i8_rows(M, N, K, &all, w, d, m, y, 0, groups);
  free(scratch);
  return 0;
}
#else
/* Built without AVX512-VNNI / AVX512-BW or AVX2: i8_has_vnni() says so, available() is False and nothing calls
   these. */
int i8_has_vnni(void) { return 0; }
void i8_quantize_rows(int M, int K, const float* x, int8_t* q, float* d, float* s, int32_t* sum) {}
int i8_gemm(int M, int N, int K, const float* x, const uint8_t* w, const uint16_t* d, const uint16_t* m, float* y,
            int threads) {
  return -1;
}
#endif
"""


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then cached), or None where they do not build or lack VNNI."""
    lib = cpu_build.load_part("cpu_gemv_i8", C_SOURCE, tuple(cpu_gemv.CFLAGS))
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """A build of C_SOURCE with its functions' argument types set, or None where it lacks the int8 kernels (neither
    AVX512-VNNI nor AVX2). benchmarks/cpu_gemv.py binds an earlier revision's build with it too."""
    if lib.i8_has_vnni() != 1:
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.i8_gemm.argtypes = [i32, i32, i32, ptr, ptr, ptr, ptr, ptr, i32]
    lib.i8_gemm.restype = ctypes.c_int
    lib.i8_quantize_rows.argtypes = [i32, i32, ptr, ptr, ptr, ptr, ptr]
    lib.i8_quantize_rows.restype = None
    return lib


def available() -> bool:
    """Whether the int8-activation kernels load on this machine (a C compiler and a CPU with AVX512-VNNI or
    AVX2)."""
    return _library() is not None


def _interleave(words: torch.Tensor, n: int, g: int, per_block: int) -> torch.Tensor:
    """int32 words [N, G * per_block] -> [ceil(N/16), G, per_block, 16] (rows past N zero), as bytes."""
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, g * per_block, dtype=torch.int32)
    padded[:n] = words
    return padded.view(groups, GROUP, g, per_block).permute(0, 2, 3, 1).contiguous().view(torch.uint8)


def _scales(t: torch.Tensor) -> torch.Tensor:
    """[N, G] float32 scales that float16 holds exactly (GGUF's are float16) -> float16 [ceil(N/16), G, 16] (rows
    past N zero): half the bytes of float32, and a tenth of what a Q4_1 row reads (d and m)."""
    n, g = t.shape
    half = t.half()
    if not torch.equal(half.float(), t):
        raise ValueError("cpu_gemv_i8: block scales must be float16 values (as GGUF stores them)")
    groups = -(-n // GROUP)
    padded = torch.zeros(groups * GROUP, g, dtype=torch.float16)
    padded[:n] = half
    return padded.view(groups, GROUP, g).transpose(1, 2).contiguous()


def repack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GGUF Q4_1 (codes uint8 [N, K/2], d/m [N, K/32]) -> (words, d, m) in the kernel's interleaved layout."""
    n, g = d.shape
    words = codes.contiguous().view(torch.int32)  # [N, G * 4]: word v of block g at g * 4 + v
    return _interleave(words, n, g, Q4_WORDS), _scales(d), _scales(m)


def repack_q8(codes: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """GGUF Q8_0 (codes int8 [N, K], d [N, K/32]) -> (words of codes + 128, d) in the kernel's layout."""
    n, g = d.shape
    shifted = (codes.to(torch.int16) + Q8_OFFSET).to(torch.uint8)
    return _interleave(shifted.view(torch.int32), n, g, Q8_WORDS), _scales(d)


class Bound:
    """A Q4_1 (m given) or Q8_0 weight repacked and checked once: `bound(x, threads)` -> x @ W^T with int8
    activations. The same interface as cpu_gemv.Bound (n, k, tensors, call); `tensors` are the repacked ones."""

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None):
        lib = _library()
        assert lib is not None, "cpu_gemv_i8.available() is False"
        self.k = codes.shape[1] * (2 if m is not None else 1)
        assert self.k % BLOCK == 0 and d.shape == (codes.shape[0], self.k // BLOCK), (codes.shape, d.shape)
        assert codes.dtype == (torch.uint8 if m is not None else torch.int8) and d.dtype == torch.float32
        self.n = codes.shape[0]
        self.tensors = repack_q4(codes, d, m) if m is not None else repack_q8(codes, d)
        self._fn = lib.i8_gemm
        self._ptrs = tuple(t.data_ptr() for t in self.tensors) + ((None,) if m is None else ())

    def __call__(self, x: torch.Tensor, threads: int) -> torch.Tensor:
        """x [M, K] float32 contiguous on the CPU -> [M, N] float32."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != self.k or x.is_cuda:
            raise ValueError(
                f"cpu_gemv_i8: x must be float32 [M, {self.k}] contiguous on the CPU, got {x.dtype} {x.shape}"
            )
        y = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if self._fn(x.shape[0], self.n, self.k, x.data_ptr(), *self._ptrs, y.data_ptr(), threads) != 0:
            raise MemoryError("cpu_gemv_i8: no memory for the quantized activation rows")
        return y


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The C quantizer on x [M, K] float32 -> (xq int8 [M, K], dx, dx * sum(xq) float32 [M, K/32], sum(xq) int32)."""
    lib = _library()
    assert lib is not None, "cpu_gemv_i8.available() is False"
    assert x.dtype == torch.float32 and x.is_contiguous() and x.dim() == 2 and x.shape[1] % BLOCK == 0, x.shape
    m, k = x.shape
    out = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK))
    total = torch.empty(m, k // BLOCK, dtype=torch.int32)
    lib.i8_quantize_rows(m, k, x.data_ptr(), *(t.data_ptr() for t in out), total.data_ptr())
    return (*out, total)


# --- the plain references -----------------------------------------------------------------------------------
def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [M, K] float32 -> (xq int8 [M, K], dx, dx * sum(xq) float32 [M, K/32], sum(xq) int32 [M, K/32])."""
    m, k = x.shape
    blocks = x.view(m, k // BLOCK, BLOCK)
    dx = blocks.abs().amax(dim=-1) / 127
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    xq = torch.round(blocks * inv[..., None])  # torch.round: half to even, as the C kernel's cvtps_epi32
    total = xq.sum(dim=-1).to(torch.int32)  # exact: at most 32 * 127
    return xq.to(torch.int8).view(m, k), dx, dx * total.float(), total


def _combine(isum: torch.Tensor, dw: torch.Tensor, dx: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """isum [M, N, G] exact integer sums -> [M, N]: per block in order, y += (dw * dx) * isum [+ offset]."""
    y = torch.zeros(isum.shape[:2])
    for g in range(isum.shape[2]):
        y = y + (dw[None, :, g] * dx[:, g, None]) * isum[:, :, g]
        if offset is not None:
            y = y + offset[:, :, g]
    return y


def _block_dots(xq: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """xq [M, K], q [N, K] integer codes -> [M, N, G] sums of each block's 32 products, exact (float64: < 2^20)."""
    m, n = xq.shape[0], q.shape[0]
    return torch.einsum("mgj,ngj->mng", xq.double().view(m, -1, BLOCK), q.double().view(n, -1, BLOCK)).float()


def q4_linear_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a GGUF Q4_1 W with int8 activations, as the C kernel computes it."""
    xq, dx, sx, _ = quantize_rows_ref(x)
    return _combine(_block_dots(xq, cpu_gemv.q4_codes(codes, d)), d, dx, m[None, :, :] * sx[:, None, :])


def q8_linear_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ W^T for a GGUF Q8_0 W with int8 activations, as the C kernel computes it."""
    xq, dx, _, _ = quantize_rows_ref(x)
    return _combine(_block_dots(xq, codes), d, dx, None)
