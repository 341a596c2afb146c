/* One decoder block of a decode step, the step's blocks in turn, and the draft heads' greedy chain, in one C call
   each (kernels/cpu_block.py). Built after every other kernel module's C, whose functions it calls. */

typedef struct {     /* one linear y = x W^T: GGUF Q4_1 (m != NULL) or Q8_0 blocks of W [n, k], or MXFP4 (fp4) */
  const void* codes;
  const void* d;     /* scales: float32 (float activations), float16 bits (int8 activations) or E8M0 (fp4) */
  const void* m;
  int n, k;
  int int8_act;      /* 1: cpu_gemv_i8's repacked blocks, int8 activations; 0: cpu_gemv's, float activations */
  int fp4;           /* 1: MXFP4 codes and E8M0 scales (cpu_gemv's fp4_gemm, or with int8_act cpu_gemv_i8's
                        fp4i8_gemm over repack_fp4's layout); 2: the same, x's blocks rotated */
} Weight;

typedef struct {
  Weight wqkv, wo, gate_up, down;
  const float* qkv_bias; /* [q_size + 2 kv_size] or NULL */
  const float* attn_norm;
  const float* mlp_norm;
  float eps;
  int hidden, q_size, kv_size, inter;
} Block;

/* Returns 0, or -1 without memory for the int8 kernel's quantized rows. */
static int linear(const Weight* w, int rows, const float* x, float* y, int threads) {
  if (w->fp4 && w->int8_act)
    return fp4i8_gemm(rows, w->n, w->k, x, (const uint8_t*)w->codes, (const uint8_t*)w->d, y, threads, w->fp4 == 2);
  if (w->fp4)
    return fp4_gemm(rows, w->n, w->k, x, (const uint8_t*)w->codes, (const uint8_t*)w->d, y, threads, w->fp4 == 2);
  if (w->int8_act)
    return i8_gemm(rows, w->n, w->k, x, (const uint8_t*)w->codes, w->d, w->m, y, threads);
  if (w->m != NULL)
    q4_gemm(rows, w->n, w->k, x, (const uint8_t*)w->codes, w->d, w->m, y, threads);
  else
    q8_gemm(rows, w->n, w->k, x, (const int8_t*)w->codes, w->d, y, threads);
  return 0;
}

/* `body` over rows [r0, r1) of T: split among the caller's `threads` where T >= PARALLEL_ROWS (a prompt's rows:
   the norms, RoPE, SiLU and the residual add were ~5% of a 2,048-token prefill on one thread while the other
   waited), else all on the calling thread (a decode step's few: a region more would be a barrier more). Rows are
   independent, so the bits do not depend on the split. (`threads` is the caller's variable of that name: the
   pragma's text is not a macro argument's.) */
#define BY_ROWS(T, body)                                                                     \
  if ((T) >= PARALLEL_ROWS && threads > 1) {                                                 \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                        \
    for (int c_ = 0; c_ < threads; c_++) {                                                   \
      const size_t r0 = (size_t)(T) * c_ / threads, r1 = (size_t)(T) * (c_ + 1) / threads;   \
      body;                                                                                  \
    }                                                                                        \
  } else {                                                                                   \
    const size_t r0 = 0, r1 = (size_t)(T);                                                   \
    body;                                                                                    \
  }

/* The floats of one block's intermediate rows for T tokens (block_rows' scratch). */
static size_t block_scratch(const Block* b, int T) {
  return (size_t)T * (4 * b->hidden + 3 * b->q_size + 3 * b->kv_size + 3 * b->inter);
}

/* x [T, hidden] -> out [T, hidden] through `scratch` (block_scratch(b, T) floats): one block for this step's T
   tokens (cos/sin [T, head_dim]); the step's keys and values go into the pages. Returns 0, or -1 when the linears'
   quantized rows cannot be allocated. */
static int block_rows(const Block* b, const Plan* p, int T, const float* x, const float* cos, const float* sin,
                      void* k_pages, uint8_t* k_scales, void* v_pages, uint8_t* v_scales, const Rotation* rot,
                      float* out, float* scratch, int threads) {
  const int H = b->hidden, Q = b->q_size, KV = b->kv_size, I = b->inter, QKV = Q + 2 * KV;
  const size_t t = (size_t)T;
  float *h = scratch, *qkv = h + t * H, *q = qkv + t * QKV, *k = q + t * Q, *att = k + t * KV;
  float *a = att + t * Q, *s = a + t * H, *gu = s + t * H, *act = gu + t * 2 * I, *m = act + t * I;
  const int D = p->head_dim;
  BY_ROWS(T, rms_norm((int)(r1 - r0), H, x + r0 * H, b->attn_norm, b->eps, h + r0 * H));
  int status = linear(&b->wqkv, T, h, qkv, threads);
  if (status == 0) {
    if (b->qkv_bias != NULL)
      for (size_t i = 0; i < t; i++)
        for (int j = 0; j < QKV; j++) qkv[i * QKV + j] += b->qkv_bias[j];
    BY_ROWS(T, rope_qk((int)(r1 - r0), p->heads, p->kv_heads, D, qkv + r0 * QKV, QKV, qkv + r0 * QKV + Q, QKV,
                       cos + r0 * D, sin + r0 * D, q + r0 * Q, k + r0 * KV));
    status = paged_attention(p, q, Q, k, KV, qkv + Q + KV, QKV, k_pages, k_scales, v_pages, v_scales, rot, att,
                             threads);
  }
  if (status == 0) status = linear(&b->wo, T, att, a, threads);
  if (status == 0) {
    BY_ROWS(T, add_rms_norm((int)(r1 - r0), H, x + r0 * H, a + r0 * H, b->mlp_norm, b->eps, s + r0 * H,
                            h + r0 * H));
    status = linear(&b->gate_up, T, h, gu, threads);
  }
  if (status == 0) {
    BY_ROWS(T, silu_mul((int)(r1 - r0), I, gu + r0 * 2 * I, act + r0 * I));
    status = linear(&b->down, T, act, m, threads);
  }
  if (status == 0)
    BY_ROWS(T, for (size_t i = r0 * H; i < r1 * H; i++) out[i] = s[i] + m[i]);
  return status;
}

/* block_rows with scratch of its own. Returns 0, or -1 when scratch memory cannot be allocated. */
int decode_block(const Block* b, const Plan* p, int T, const float* x, const float* cos, const float* sin,
                 void* k_pages, uint8_t* k_scales, void* v_pages, uint8_t* v_scales, const Rotation* rot, float* out,
                 int threads) {
  float* scratch = malloc(block_scratch(b, T) * sizeof(float));
  if (scratch == NULL) return -1;
  const int status = block_rows(b, p, T, x, cos, sin, k_pages, k_scales, v_pages, v_scales, rot, out, scratch,
                                threads);
  free(scratch);
  return status;
}

/* The step's blocks in turn, x [T, hidden] -> out (one call instead of one per block). Layer l reads pages[5 l ..
   5 l + 4] (key elements, key scales, value elements, value scales, rotation, as decode_block takes them) and, where
   taps[l] is not NULL, copies its output there. One scratch serves every block: a prompt's is tens of MB (37 MB
   at 1,024 rows), which malloc maps fresh and the kernel zero-fills page by page on each allocation, so one per
   block made a 1,024-token prefill 1.5x slower (docs/benchmarks.md, thirty-sixth session). Returns 0, or -1 when
   scratch memory cannot be allocated. */
int decode_layers(const Block* const* blocks, int layers, const Plan* p, int T, const float* x, const float* cos,
                  const float* sin, void* const* pages, float* const* taps, float* out, int threads) {
  const size_t n = (size_t)T * blocks[0]->hidden;
  size_t floats = 0;
  for (int l = 0; l < layers; l++)
    if (block_scratch(blocks[l], T) > floats) floats = block_scratch(blocks[l], T);
  float* other = malloc((n + floats) * sizeof(float));
  if (other == NULL) return -1;
  const float* in = x;
  int status = 0;
  for (int l = 0; l < layers && status == 0; l++) {
    float* dst = (layers - l) % 2 ? out : other;  /* the last layer writes out */
    void* const* pg = pages + 5 * (size_t)l;
    status = block_rows(blocks[l], p, T, in, cos, sin, pg[0], pg[1], pg[2], pg[3], pg[4], dst, other + n, threads);
    if (status == 0 && taps[l] != NULL) memcpy(taps[l], dst, n * sizeof(float));
    in = dst;
  }
  free(other);
  return status;
}

typedef struct {    /* one sequential draft head (engine/drafters/heads.py HeadBlock) */
  Weight up, down;  /* up [ffn, 2 hidden], down [hidden, ffn] */
  const float* state_norm;
  const float* embed_norm;
} Head;

typedef struct {         /* the heads and the target's parts they draft through */
  const Head* heads;
  Weight rows;           /* the lm_head's draft-vocabulary rows [Vd, hidden] */
  const float* out_norm; /* the target's final norm */
  const void* embed;     /* the target's embedding [vocab, hidden]: float32, or bfloat16 where embed_bf16 */
  const int64_t* vocab;  /* draft-vocabulary row -> token id */
  float eps, out_eps;
  int hidden, ffn;
  long embed_rows;
  int embed_bf16;
} Heads;

/* Row `token` of the embedding as float32: in place, or widened into `scratch` [hidden] from bfloat16 (exact). */
static const float* embed_row(const Heads* h, int64_t token, float* scratch) {
  const size_t at = (size_t)token * h->hidden;
  if (!h->embed_bf16) return (const float*)h->embed + at;
  const uint16_t* row = (const uint16_t*)h->embed + at;
  for (int i = 0; i < h->hidden; i++) {
    const uint32_t bits = (uint32_t)row[i] << 16;
    memcpy(scratch + i, &bits, sizeof(float));
  }
  return scratch;
}

/* softmax(logits)[best] over n logits, given logits[best] is their largest: 1 / sum_j exp(l_j - l_best) (NaN where
   that largest is NaN or -inf). */
static float top_probability(int n, const float* logits, float top) {
  float acc[LANES];  /* LANES sums, so that the loop vectorizes */
  int j = exp_lanes(logits, n, top, NULL, acc);
  for (; j < n; j++) acc[0] += exp_poly(logits[j] - top);
  return top == top && top != -INFINITY ? 1.0f / lanes_total(acc) : NAN;
}

/* The heads' greedy chain for B requests: hidden[i] (request i's h_t, [hidden]) and prev [B] (their newest tokens)
   -> out [B, depth] draft token ids and conf [B, depth] the probability each draft had under its head's softmax
   over the draft vocabulary. Per position the calls of HeadBlock.forward and DraftVocabOutput in their order
   (s = s + down(silu(up([norm(s); norm(E[prev])]))), the draft logits of norm(s), their argmax), so the same
   bits as the packed modules. It stops early once every request's chain probability (the product of its drafts'
   probabilities) is below `floor`. Returns the positions drafted (1..depth; out and conf hold them first in each
   row), -1 without memory for its rows, or -2 for a prev outside the embedding. */
int draft_chain(const Heads* h, int B, int depth, const float* const* hidden, const int64_t* prev, int64_t* out,
                float* conf, float floor, int threads) {
  const int H = h->hidden, F = h->ffn, V = h->rows.n;
  const size_t b = (size_t)B;
  for (size_t i = 0; i < b; i++)
    if (prev[i] < 0 || prev[i] >= h->embed_rows) return -2;
  int64_t* best = malloc(b * sizeof(int64_t) + (b * (5 * H + F + V + 1) + H) * sizeof(float));  /* longs first */
  if (best == NULL) return -1;
  float *state = (float*)(best + b), *u = state + b * H, *act = u + b * 2 * H, *delta = act + b * F;
  float *normed = delta + b * H, *logits = normed + b * H, *reach = logits + b * V, *wide = reach + b;
  for (size_t i = 0; i < b; i++) {
    memcpy(state + i * H, hidden[i], H * sizeof(float));
    reach[i] = 1.0f;
  }
  int status = 0, drafted = 0;
  for (int j = 0; j < depth && status == 0; j++) {
    const Head* head = h->heads + j;
    for (size_t i = 0; i < b; i++) {
      const int64_t token = j == 0 ? prev[i] : out[i * depth + j - 1];
      rms_norm(1, H, state + i * H, head->state_norm, h->eps, u + i * 2 * H);
      rms_norm(1, H, embed_row(h, token, wide), head->embed_norm, h->eps, u + i * 2 * H + H);
    }
    status = linear(&head->up, B, u, act, threads);
    if (status == 0) {
      silu(B, F, act, act);
      status = linear(&head->down, B, act, delta, threads);
    }
    if (status == 0) {
      for (size_t i = 0; i < b * H; i++) state[i] += delta[i];
      rms_norm(B, H, state, h->out_norm, h->out_eps, normed);
      status = linear(&h->rows, B, normed, logits, threads);
    }
    if (status == 0) status = argmax_rows(B, V, logits, best, threads);
    if (status != 0) break;
    int onward = 0;
    for (size_t i = 0; i < b; i++) {
      const float* row = logits + i * V;
      out[i * depth + j] = h->vocab[best[i]];
      conf[i * depth + j] = top_probability(V, row, row[best[i]]);
      reach[i] *= conf[i * depth + j];
      onward |= reach[i] >= floor;
    }
    drafted = j + 1;
    if (!onward) break;
  }
  free(best);
  return status != 0 ? status : drafted;
}
