/* Block-quantized matrix products with int8 activations, AVX512-VNNI or AVX2 (kernels/cpu_gemv_i8.py: the math,
   the repacked layout, the bindings and the torch references). Built after fwht32.h. */

#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#define I8_MMAX 8  /* activation rows a tile keeps in registers */
/* Bytes ahead of each weight load to prefetch: the head (28 MB on the default model) streams from L3 ~1.5x
   faster with it (benchmarks/cpu_gemv.py; 512-4096 measured, 1024 best). */
#define I8_PF 1024

/* Activation rows quantized per block of 32: q [M, K] int8, d [M, G] scale, s [M, G] = d * sum(q) (Q4_1's
   offset term), sum [M, G] = sum(q) (the correction of Q8_0's +128 codes and MXFP4's +12 ones). */
typedef struct {
  int8_t* q;
  float* d;
  float* s;
  int32_t* sum;
} Acts;

enum { I8_Q8 = 0, I8_Q4 = 1, I8_FP4 = 2 }; /* the weights a tile reads: GGUF Q8_0, GGUF Q4_1, MXFP4 */

/* MXFP4 element codes (bit 3 the sign; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 by code & 7) as dpbusd's unsigned
   operand: twice the value plus FP4_OFFSET, 0..24, exact. One shuffle_epi8 looks up 16 codes' bytes at once. */
#define FP4_OFFSET 12
#define FP4_TABLE 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define I8_INLINE static inline __attribute__((always_inline))

#define I8_OK 1

/* One block of 32 (its elements 0-15 in lo, 16-31 in hi): dx = amax / 127, xq = round-half-even(x * (1 / dx))
   (cvtps_epi32 under the default rounding mode), 0 where amax = 0; |x * (1 / dx)| <= 127 up to one rounding, so the
   saturating pack to int8 never clips. */
I8_INLINE void i8_quantize_lanes(__m512 lo, __m512 hi, int8_t* q, float* d, float* s, int32_t* sum) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
  const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
  const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(ql));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qh));
  const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh));
  *d = db;
  *sum = total;
  *s = db * (float)total;
}

/* One butterfly stage of fwht32 over 16 lanes, for h = 1, 2, 4 or 8: `partner` holds each lane's partner (lane
   t +- h), `upper` marks the lanes t + h, which get partner - v = v[t] - v[t + h]; the others v + partner. Each
   lane is the scalar loop's a + b or a - b of the same two floats, so the same bits. */
I8_INLINE __m512 butterfly(__m512 v, __m512 partner, __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(v, partner), upper, partner, v);
}

I8_INLINE void i8_quantize_block(int rotate, const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
  if (rotate) { /* fwht32 in registers: h = 1, 2, 4, 8 within each half, then 16 across them */
    for (int half = 0; half < 2; half++) {
      __m512 v = half ? hi : lo;
      v = butterfly(v, _mm512_permute_ps(v, 0xB1), 0xAAAA);
      v = butterfly(v, _mm512_permute_ps(v, 0x4E), 0xCCCC);
      v = butterfly(v, _mm512_shuffle_f32x4(v, v, 0xB1), 0xF0F0);
      v = butterfly(v, _mm512_shuffle_f32x4(v, v, 0x4E), 0xFF00);
      if (half) hi = v; else lo = v;
    }
    const __m512 scale = _mm512_set1_ps(0.17677669529663687f), sum16 = _mm512_add_ps(lo, hi);
    hi = _mm512_mul_ps(_mm512_sub_ps(lo, hi), scale);
    lo = _mm512_mul_ps(sum16, scale);
  }
  i8_quantize_lanes(lo, hi, q, d, s, sum);
}

/* 16 float16 scales -> float32 (exact: every float16 is a float32). */
I8_INLINE __m512 load_half16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

/* 16 E8M0 scales e -> the float32 whose exponent bits are e: 2^(e - 127) for e = 1..254, 0.0 for e = 0 (the
   exact 2^-127 is a float32 subnormal; repack_fp4 refuses e = 255, NaN). */
I8_INLINE __m512 load_e8m0_16(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)), 23));
}

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
   so the accumulators live in registers), of 4-bit codes in Q4_1's nibble order: Q4_1's own (KIND I8_Q4), or
   MXFP4's (I8_FP4: repack_fp4 stores them in that order), each code then looked up as 2 e2m1(code) + FP4_OFFSET,
   the low chain starting at -FP4_OFFSET * sum(xq), so the two end as sum_j 2 e2m1(c_j) xq_j, exactly. Two integer
   chains per (row, group), low and high nibbles, to hide dpbusd's latency; their sum is exact. Then Q4_1:
   acc += (d * dx) * isum, then acc += m * (dx * sum xq); MXFP4: acc += (2^(e - 127) * (dx / 2)) * isum. */
I8_INLINE void nib_i8_tile(const int KIND, const int R, const int NR, int N, int K, const Acts* a, const uint8_t* w,
                           const void* scales, const uint16_t* m, float* y, int grp) {
  const int G = K / 32, fp4 = KIND == I8_FP4;
  const __m512i nibble = _mm512_set1_epi8(0x0F), table = _mm512_broadcast_i32x4(_mm_setr_epi8(FP4_TABLE));
  __m512 acc[I8_MMAX][4];
  for (int i = 0; i < R; i++)
    for (int r = 0; r < NR; r++) acc[i][r] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m512i lo_sum[I8_MMAX][4], hi_sum[I8_MMAX][4];
    for (int i = 0; i < R; i++)
      for (int r = 0; r < NR; r++) {
        lo_sum[i][r] = fp4 ? _mm512_set1_epi32(-FP4_OFFSET * a->sum[(size_t)i * G + g]) : _mm512_setzero_si512();
        hi_sum[i][r] = _mm512_setzero_si512();
      }
    for (int v = 0; v < 4; v++)
      for (int r = 0; r < NR; r++) {
        const uint8_t* b = w + (((size_t)(grp + r) * G + g) * 4 + v) * 64;
        _mm_prefetch((const char*)(b + I8_PF), _MM_HINT_T0);
        const __m512i packed = _mm512_loadu_si512(b);
        __m512i wl = _mm512_and_si512(packed, nibble), wh = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
        if (fp4) {
          wl = _mm512_shuffle_epi8(table, wl);
          wh = _mm512_shuffle_epi8(table, wh);
        }
        for (int i = 0; i < R; i++) {
          const int8_t* xq = a->q + (size_t)i * K + g * 32 + 4 * v;
          lo_sum[i][r] = _mm512_dpbusd_epi32(lo_sum[i][r], wl, broadcast_word(xq));
          hi_sum[i][r] = _mm512_dpbusd_epi32(hi_sum[i][r], wh, broadcast_word(xq + 16));
        }
      }
    for (int r = 0; r < NR; r++) {
      const size_t at = ((size_t)(grp + r) * G + g) * 16;
      const __m512 dg = fp4 ? load_e8m0_16((const uint8_t*)scales + at) : load_half16((const uint16_t*)scales + at);
      const __m512 mg = fp4 ? _mm512_setzero_ps() : load_half16(m + at);
      for (int i = 0; i < R; i++) {
        const float dx = a->d[(size_t)i * G + g];
        acc[i][r] = combine(acc[i][r], _mm512_add_epi32(lo_sum[i][r], hi_sum[i][r]), dg, fp4 ? 0.5f * dx : dx);
        if (!fp4) acc[i][r] = _mm512_add_ps(acc[i][r], _mm512_mul_ps(mg, _mm512_set1_ps(a->s[(size_t)i * G + g])));
      }
    }
  }
  store_groups(R, NR, N, acc, y, grp);
}

I8_INLINE void q4i8_tile(const int R, const int NR, int N, int K, const Acts* a, const uint8_t* w, const uint16_t* d,
                         const uint16_t* m, float* y, int grp) {
  nib_i8_tile(I8_Q4, R, NR, N, K, a, w, d, m, y, grp);
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

I8_INLINE void fp4i8_tile(const int R, const int NR, int N, int K, const Acts* a, const uint8_t* w, const uint8_t* e,
                          float* y, int grp) {
  nib_i8_tile(I8_FP4, R, NR, N, K, a, w, e, NULL, y, grp);
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

static void fp4i8_chunk(int rows, int N, int K, const Acts* a, const uint8_t* w, const uint8_t* e, float* y, int g0,
                        int g1) {
  I8_DISPATCH(fp4i8_tile, w, e)
}

static void i8_chunk(int kind, int rows, int N, int K, const Acts* a, const uint8_t* w, const void* d,
                     const uint16_t* m, float* y, int g0, int g1) {
  if (kind == I8_Q4)
    q4i8_chunk(rows, N, K, a, w, (const uint16_t*)d, m, y, g0, g1);
  else if (kind == I8_Q8)
    q8i8_chunk(rows, N, K, a, w, (const uint16_t*)d, y, g0, g1);
  else
    fp4i8_chunk(rows, N, K, a, w, (const uint8_t*)d, y, g0, g1);
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

/* The AVX-512 quantization's math: dx = amax / 127, xq = round-half-even(x * (1 / dx)), 0 where amax = 0; where
   `rotate`, of the block times R (the scalar fwht32: the same bits as the AVX-512 butterflies). */
I8_INLINE void i8_quantize_block(int rotate, const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  float rotated[32];
  if (rotate) {
    memcpy(rotated, x, sizeof rotated);
    fwht32(rotated);
    x = rotated;
  }
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], mx;
  for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + 8 * j);
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
    q[j] = (int8_t)qi[j];
    total += qi[j];
  }
  *d = db;
  *sum = total;
  *s = db * (float)total;
}

I8_INLINE __m256 load_half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

/* 8 E8M0 scales -> float32 from their exponent bits, as the AVX-512 tiles' load_e8m0_16 (e = 0: 0.0). */
I8_INLINE __m256 load_e8m0_8(const uint8_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)), 23));
}

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
   once per block (one madd); Q8_0's (at most 2 x 128 x 127) are widened at once, and so are MXFP4's (a word's
   two pairs at most 4 x 24 x 127; eight would pass 32,767), after a start at -FP4_OFFSET * sum(xq). The same
   integers as dpbusd. */
I8_INLINE void i8_half(const int KIND, const int R, int N, int K, const Acts* a, const uint8_t* w, const void* d,
                       const uint16_t* m, float* y, int grp, int h) {
  const int G = K / 32, words = KIND == I8_Q8 ? 8 : 4;
  const __m256i nibble = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_setr_epi8(FP4_TABLE));
  __m256 acc[I8_RMAX2];
  for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    __m256i sum[I8_RMAX2];
    for (int i = 0; i < R; i++)
      sum[i] = KIND == I8_FP4 ? _mm256_set1_epi32(-FP4_OFFSET * a->sum[(size_t)i * G + g]) : _mm256_setzero_si256();
    const uint8_t* blk = w + ((size_t)grp * G + g) * words * 64 + 32 * h;
    for (int v = 0; v < words; v++) {
      /* Every 64-byte line ahead, as the AVX-512 tiles do, in the first half's pass (the second reads the same
         lines from L1). One line a block left the head's stream to the hardware prefetcher: 1.7x slower at one
         row on an AMD EPYC (docs/benchmarks.md, thirty-third session). */
      if (h == 0) _mm_prefetch((const char*)(blk + (size_t)v * 64 + I8_PF), _MM_HINT_T0);
      const __m256i packed = _mm256_loadu_si256((const __m256i*)(blk + (size_t)v * 64));
      if (KIND != I8_Q8) {
        __m256i wl = _mm256_and_si256(packed, nibble), wh = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
        if (KIND == I8_FP4) {
          wl = _mm256_shuffle_epi8(table, wl);
          wh = _mm256_shuffle_epi8(table, wh);
        }
        for (int i = 0; i < R; i++) {
          const int8_t* xq = a->q + (size_t)i * K + g * 32 + 4 * v;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(wl, word8(xq)),
                                                 _mm256_maddubs_epi16(wh, word8(xq + 16)));
          sum[i] = KIND == I8_Q4 ? _mm256_add_epi16(sum[i], pairs)
                                 : _mm256_add_epi32(sum[i], _mm256_madd_epi16(pairs, ones));
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
    const __m256 dg = KIND == I8_FP4 ? load_e8m0_8((const uint8_t*)d + at) : load_half8((const uint16_t*)d + at);
    const __m256 mg = KIND == I8_Q4 ? load_half8(m + at) : _mm256_setzero_ps();
    for (int i = 0; i < R; i++) {
      const __m256i isum = KIND == I8_Q4 ? _mm256_madd_epi16(sum[i], ones) : sum[i];
      const float dx = a->d[(size_t)i * G + g];
      acc[i] = combine8(acc[i], isum, dg, KIND == I8_FP4 ? 0.5f * dx : dx);
      if (KIND == I8_Q4) acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(mg, _mm256_set1_ps(a->s[(size_t)i * G + g])));
    }
  }
  store8(R, N, acc, y, grp * 16 + 8 * h);
}

I8_INLINE void i8_rows2(const int KIND, int rows, int N, int K, const Acts* a, const uint8_t* w, const void* d,
                        const uint16_t* m, float* y, int g0, int g1) {
  for (int i0 = 0; i0 < rows; i0 += I8_RMAX2) {
    const int G = K / 32, r = rows - i0 < I8_RMAX2 ? rows - i0 : I8_RMAX2;
    const Acts sub = {a->q + (size_t)i0 * K, a->d + (size_t)i0 * G, a->s + (size_t)i0 * G, a->sum + (size_t)i0 * G};
    float* yi = y + (size_t)i0 * N;
    for (int grp = g0; grp < g1; grp++)
      for (int h = 0; h < 2; h++) {
        if (grp * 16 + 8 * h >= N) break;
        switch (r) {
          case 1: i8_half(KIND, 1, N, K, &sub, w, d, m, yi, grp, h); break;
          case 2: i8_half(KIND, 2, N, K, &sub, w, d, m, yi, grp, h); break;
          case 3: i8_half(KIND, 3, N, K, &sub, w, d, m, yi, grp, h); break;
          case 4: i8_half(KIND, 4, N, K, &sub, w, d, m, yi, grp, h); break;
          default: i8_half(KIND, 5, N, K, &sub, w, d, m, yi, grp, h); break;
        }
      }
  }
}

static void i8_chunk(int kind, int rows, int N, int K, const Acts* a, const uint8_t* w, const void* d,
                     const uint16_t* m, float* y, int g0, int g1) {
  if (kind == I8_Q4)
    i8_rows2(I8_Q4, rows, N, K, a, w, d, m, y, g0, g1);
  else if (kind == I8_Q8)
    i8_rows2(I8_Q8, rows, N, K, a, w, d, m, y, g0, g1);
  else
    i8_rows2(I8_FP4, rows, N, K, a, w, d, m, y, g0, g1);
}
#endif

#ifdef I8_OK
int i8_has_vnni(void) { return 1; }

/* Rows r0 .. r1 - 1 of x quantized per block into `all`, each block first times R where `rotate`. */
static void i8_prepare(int rotate, size_t r0, size_t r1, int K, const float* x, const Acts* all) {
  const size_t G = (size_t)K / 32;
  for (size_t b = r0 * G; b < r1 * G; b++)
    i8_quantize_block(rotate, x + b * 32, all->q + b * 32, all->d + b, all->s + b, all->sum + b);
}

/* x [M, K] -> q [M, K], d, s, sum [M, K / 32] (Acts); `rotate`: x's blocks times R first. */
void i8_quantize_rows(int M, int K, const float* x, int8_t* q, float* d, float* s, int32_t* sum, int rotate) {
  const Acts all = {q, d, s, sum};
  i8_prepare(rotate, 0, (size_t)M, K, x, &all);
}

/* Groups g0 .. g1 - 1 of 16 outputs of all M rows (quantized: `all`), I8_MMAX rows at a time. */
static void i8_rows(int kind, int M, int N, int K, const Acts* all, const uint8_t* w, const void* d,
                    const uint16_t* m, float* y, int g0, int g1) {
  const int G = K / 32;
  for (int i0 = 0; i0 < M; i0 += I8_MMAX) {
    const int rows = M - i0 < I8_MMAX ? M - i0 : I8_MMAX;
    const size_t at = (size_t)i0 * G;
    const Acts a = {all->q + (size_t)i0 * K, all->d + at, all->s + at, all->sum + at};
    i8_chunk(kind, rows, N, K, &a, w, d, m, y + (size_t)i0 * N, g0, g1);
  }
}

/* y [M, N] = x [M, K] W^T for repacked weights of `kind` (`rotate`: x's blocks times R first): the rows quantized
   once, then I8_MMAX rows at a time, `threads` > 1 splitting the groups of 16 outputs, each thread taking its groups
   of every row chunk in one OpenMP region (a region per chunk, 256 for a 2,048-row prompt, made each thread wait for
   the other 256 times a linear: with a third busy process on 2 cores a 2,048-token prefill took 42 s against 16;
   docs/benchmarks.md, thirty-fifth session). Returns 0, or -1 without memory for the quantized rows. */
#define I8_PARALLEL_QUANTIZE 32 /* rows from which the threads quantize them too (a prompt's: 2.7% of a 2,048-token
                                   prefill on one thread; a decode step's stay on the caller, without a barrier) */
static int i8_run(int kind, int rotate, int M, int N, int K, const float* x, const uint8_t* w, const void* d,
                  const uint16_t* m, float* y, int threads) {
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
      for (int t = 0; t < threads; t++)
        i8_prepare(rotate, (size_t)M * t / threads, (size_t)M * (t + 1) / threads, K, x, &all);
      /* (the loop's barrier: every row quantized before any is read) */
#pragma omp for schedule(static)
      for (int t = 0; t < threads; t++)
        i8_rows(kind, M, N, K, &all, w, d, m, y, (int)((long)groups * t / threads),
                (int)((long)groups * (t + 1) / threads));
    }
    free(scratch);
    return 0;
  }
#endif
  i8_prepare(rotate, 0, (size_t)M, K, x, &all);
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++)
      i8_rows(kind, M, N, K, &all, w, d, m, y, (int)((long)groups * t / threads),
              (int)((long)groups * (t + 1) / threads));
  } else
#endif
    i8_rows(kind, M, N, K, &all, w, d, m, y, 0, groups);
  free(scratch);
  return 0;
}

/* Repacked Q4_1 (m != NULL: float16 scales d and offsets m) or Q8_0 (m == NULL) weights. */
int i8_gemm(int M, int N, int K, const float* x, const uint8_t* w, const uint16_t* d, const uint16_t* m, float* y,
            int threads) {
  return i8_run(m != NULL ? I8_Q4 : I8_Q8, 0, M, N, K, x, w, d, m, y, threads);
}

/* Repacked MXFP4 weights (repack_fp4: codes w, E8M0 scales e); `rotate`: a RotatedFp4Linear's, x's blocks times R
   before they are quantized. */
int fp4i8_gemm(int M, int N, int K, const float* x, const uint8_t* w, const uint8_t* e, float* y, int threads,
               int rotate) {
  return i8_run(I8_FP4, rotate, M, N, K, x, w, e, NULL, y, threads);
}
#else
/* Built without AVX512-VNNI / AVX512-BW or AVX2: i8_has_vnni() says so, available() is False and nothing calls
   these. */
int i8_has_vnni(void) { return 0; }
void i8_quantize_rows(int M, int K, const float* x, int8_t* q, float* d, float* s, int32_t* sum, int rotate) {}
int i8_gemm(int M, int N, int K, const float* x, const uint8_t* w, const uint16_t* d, const uint16_t* m, float* y,
            int threads) {
  return -1;
}
int fp4i8_gemm(int M, int N, int K, const float* x, const uint8_t* w, const uint8_t* e, float* y, int threads,
               int rotate) {
  return -1;
}
#endif
