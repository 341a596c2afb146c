/* Paged attention's step (paged_attention) and the quantize-on-append (quantize_rows), over the kernels of
   cpu_attention_kernels.c, which are built before it (kernels/cpu_attention.py: the bindings and references). */

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
