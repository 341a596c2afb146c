/* The 32-point fast Walsh-Hadamard transform of a RotatedFp4Linear's rows (x's blocks times R = H_32 / sqrt(32)).
   Its text goes before cpu_gemv.c's and cpu_gemv_i8.c's (kernels/cpu_build.c_source); guarded, so a library of
   both holds it once. */

#ifndef SPECCHAT_FWHT32
#define SPECCHAT_FWHT32
/* A block of 32 times R, in place: butterflies h = 1, 2, 4, 8, 16, then 1 / sqrt(32) (cpu_gemv_i8.fwht_ref). */
static inline void fwht32(float v[32]) {
  for (int h = 1; h < 32; h *= 2)
    for (int j = 0; j < 32; j += 2 * h)
      for (int t = j; t < j + h; t++) {
        const float a = v[t], b = v[t + h];
        v[t] = a + b;
        v[t + h] = a - b;
      }
  for (int j = 0; j < 32; j++) v[j] *= 0.17677669529663687f; /* 1 / sqrt(32) */
}
#endif
