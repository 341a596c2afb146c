/* What the CPU kernels' C builds on: includes, macros and inline helpers (exp, fixed-order sums, a row's norm).
   Not #included: its text goes before cpu_ops.c's, cpu_attention_kernels.c's and, in kernels/cpu_block.py's
   library, both translation units' (kernels/cpu_build.c_source). */

#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#define LANES 16
#define INLINE static inline __attribute__((always_inline))

/* exp(x), Cephes' expf: x = n ln2 + r (ln2 split in two for an exact product), e^r by a degree-5 polynomial,
   2^n put in the exponent bits; n rounded with the 1.5 * 2^23 trick so loops calling it vectorize. */
INLINE float exp_poly(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

/* exp_poly on a vector V of floats, P the intrinsics' prefix (_mm256, _mm512), CAST its integer -> float bits
   cast: the same operations in the same order (no contraction), so the same bits; the clamps keep a NaN as
   exp_poly's comparisons do (max / min return their second operand where either is NaN). A scalar loop calling
   exp_poly does not vectorize (its clamps compile to branches). */
#define DEFINE_EXP(NAME, V, VI, P, CAST)                                                                 \
  INLINE V NAME(V x) {                                                                                   \
    x = P##_min_ps(P##_set1_ps(88.0f), P##_max_ps(P##_set1_ps(-87.0f), x));                              \
    const V round = P##_set1_ps(12582912.0f);                                                            \
    const V n = P##_sub_ps(P##_add_ps(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)), round), round); \
    V r = P##_sub_ps(x, P##_mul_ps(n, P##_set1_ps(0.693359375f)));                                       \
    r = P##_add_ps(r, P##_mul_ps(n, P##_set1_ps(2.12194440e-4f)));                                       \
    V p = P##_set1_ps(1.9875691500e-4f);                                                                 \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(1.3981999507e-3f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(8.3334519073e-3f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(4.1665795894e-2f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(1.6666665459e-1f));                                     \
    p = P##_add_ps(P##_mul_ps(p, r), P##_set1_ps(5.0000001201e-1f));                                     \
    const V e = P##_add_ps(P##_add_ps(P##_mul_ps(p, P##_mul_ps(r, r)), r), P##_set1_ps(1.0f));           \
    const VI bits = P##_slli_epi32(P##_add_epi32(P##_cvttps_epi32(n), P##_set1_epi32(127)), 23);         \
    return P##_mul_ps(e, CAST(bits));                                                                    \
  }

#ifdef __AVX2__
#include <immintrin.h>
#define HAVE_EXP8 1
DEFINE_EXP(exp8, __m256, __m256i, _mm256, _mm256_castsi256_ps)
#endif

#ifdef __AVX512F__
DEFINE_EXP(exp16, __m512, __m512i, _mm512, _mm512_castsi512_ps)
#endif

/* The first pass of a LANES-lane sum of exp(x[j] - m): for j below n rounded down to LANES, e_j = exp_poly(x[j] - m)
   written to out[j] (out may be x; NULL: not written) and added to acc[j % LANES] in order of j, the acc (LANES
   floats) starting at zero. Returns where it stopped. One pass where exp, store and sum were two (on 8 lanes, or
   16 in AVX-512 builds); the bits are lane_sum's of the e_j, and the e_j exp_poly's. */
INLINE int exp_lanes(const float* x, int n, float m, float* out, float* acc) {
  int j = 0;
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; j + LANES <= n; j += LANES) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv));
    if (out != NULL) _mm512_storeu_ps(out + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(acc, sum);
#elif defined(HAVE_EXP8)
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; j + LANES <= n; j += LANES) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), mv));
    if (out != NULL) _mm256_storeu_ps(out + j, e0), _mm256_storeu_ps(out + j + 8, e1);
    lo = _mm256_add_ps(lo, e0), hi = _mm256_add_ps(hi, e1);
  }
  _mm256_storeu_ps(acc, lo), _mm256_storeu_ps(acc + 8, hi);
#else
  for (int l = 0; l < LANES; l++) acc[l] = 0.0f;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) {
      const float e = exp_poly(x[j + l] - m);
      if (out != NULL) out[j + l] = e;
      acc[l] += e;
    }
#endif
  return j;
}

/* The LANES partial sums of acc halved pairwise into one (acc is overwritten). */
INLINE float lanes_total(float* acc) {
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

/* A sum in a fixed order: LANES partial sums over the row, then halved pairwise. */
INLINE float lane_sum(const float* x, int n, int square) {
  float acc[LANES] = {0};
  int j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; l++) acc[l] += square ? x[j + l] * x[j + l] : x[j + l];
  for (int l = 0; j < n; j++, l++) acc[l] += square ? x[j] * x[j] : x[j];
  return lanes_total(acc);
}

INLINE void norm_row(int n, const float* x, const float* w, float eps, float* out) {
  const float r = 1.0f / sqrtf(lane_sum(x, n, 1) / (float)n + eps);
  for (int j = 0; j < n; j++) out[j] = w[j] * (x[j] * r);
}
