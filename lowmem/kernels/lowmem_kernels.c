/* lowmem's fused optimizer updates for 16-bit tensors on the CPU (lowmem/kernels/cpu.py builds and
 * loads this file). One call updates a whole list of tensors: weights, gradients and optimizer
 * state stay in FP16 or BF16, every element is computed in FP32 registers, nothing is allocated.
 *
 * The arithmetic is lowmem/kernels/reference.py's, operation for operation, in the same order, each
 * one correctly rounded FP32 operation and none fused: built with -ffp-contract=off, `a + b * c` is a
 * multiply and an add here as in the reference, whatever the CPU (an explicit fmaf only where the torch op
 * it reproduces fuses, as BN's kernel does: lowmem_norm_relu; see that file for the definitions;
 * lowmem/kernels/triton_kernels.py is the CUDA twin).
 * Tensors are passed as arrays of addresses (int64) with their element counts.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FP16 = 0, BF16 = 1, FP32 = 2 };

static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float load16(const uint16_t *p, int64_t i, int dtype) {
    if (dtype == BF16) return bits_float((uint32_t)p[i] << 16);
    _Float16 h; memcpy(&h, p + i, 2); return (float)h;
}

/* Round to nearest even (torch's conversions). */
static inline uint16_t round_nearest(float f, int dtype) {
    if (dtype == BF16) {
        uint32_t u = float_bits(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
        return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    _Float16 h = (_Float16)f; uint16_t out; memcpy(&out, &h, 2); return out;
}

static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16; return h;
}

/* 24 random bits for element i of the tensor whose key is `key` (counter-based: no state). */
static inline uint32_t random24(uint32_t key, uint32_t i) { return fmix32(key ^ (i * 0x27d4eb2fu)) >> 8; }

/* Stochastic rounding of |f| up with probability equal to its distance from the lower neighbour,
 * in units of the 16-bit spacing there (unbiased); r24 uniform in [0, 2^24). */
static inline uint16_t round_stochastic(float f, uint32_t r24, int dtype) {
    uint32_t u = float_bits(f), sign = u & 0x80000000u, mag = u & 0x7fffffffu;
    if (mag >= 0x7f800000u) return round_nearest(f, dtype);
    if (dtype == BF16) return (uint16_t)((sign | ((mag + (r24 >> 8)) & 0xffff0000u)) >> 16);
    float rounded;
    if (mag < 0x38800000u) { /* below 2^-14: FP16's fixed subnormal spacing 2^-24 */
        float q = bits_float(mag) * 0x1p24f, lower = floorf(q);
        float up = ((float)r24 * 0x1p-24f < q - lower) ? 1.0f : 0.0f;
        rounded = bits_float(sign | float_bits((lower + up) * 0x1p-24f));
    } else {
        rounded = bits_float(sign | ((mag + (r24 >> 11)) & ~0x1fffu));
    }
    return round_nearest(rounded, dtype); /* exact, or infinity beyond FP16's range */
}

static inline uint16_t store_weight(float w, int stochastic, uint32_t key, int64_t i, int dtype) {
    return stochastic ? round_stochastic(w, random24(key, (uint32_t)i), dtype) : round_nearest(w, dtype);
}

/* 2^k for an integer k in [-126, 127]. */
static inline float pow2(int k) { return bits_float((uint32_t)(k + 127) << 23); }

/* The loops below are written once, as always-inlined functions of the dtype and the rounding, and
 * called with each combination as constants (SPECIALIZED): the compiler then vectorizes every
 * variant (a runtime dtype inside the loop would keep it scalar). Vectorizing changes no result:
 * each element's operations are the same correctly rounded FP32 operations, none fused. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define SPECIALIZED(call, dtype, stochastic)                                                       \
    do {                                                                                            \
        if ((dtype) == BF16) { if (stochastic) call(BF16, 1); else call(BF16, 0); }                 \
        else { if (stochastic) call(FP16, 1); else call(FP16, 0); }                                 \
    } while (0)

ALWAYS_INLINE void sgd_tensor(uint16_t *w, const uint16_t *g, uint16_t *b, int64_t size, uint32_t key, float lr,
                              float momentum, int nesterov, float weight_decay, float grad_scale, int dtype,
                              int stochastic) {
    for (int64_t i = 0; i < size; i++) {
        float weight = load16(w, i, dtype);
        float grad = load16(g, i, dtype) / grad_scale;
        if (weight_decay != 0.0f) grad = grad + weight * weight_decay;
        float update = grad;
        if (b) {
            float buffer = load16(b, i, dtype) * momentum + grad;
            update = nesterov ? grad + buffer * momentum : buffer;
            b[i] = round_nearest(buffer, dtype);
        }
        w[i] = store_weight(weight + update * -lr, stochastic, key, i, dtype);
    }
}

void lowmem_sgd(int64_t count, const int64_t *weights, const int64_t *grads, const int64_t *momenta,
                const int64_t *sizes, const uint32_t *keys, int dtype, float lr, float momentum, int nesterov,
                float weight_decay, float grad_scale, int stochastic) {
    for (int64_t t = 0; t < count; t++) {
        uint16_t *w = (uint16_t *)weights[t];
        const uint16_t *g = (const uint16_t *)grads[t];
        uint16_t *b = momentum != 0.0f ? (uint16_t *)momenta[t] : 0;
        /* The loop-invariant choices as constants too, so that each loop is branch-free. */
#define SGD(D, S)                                                                                          \
    do {                                                                                                   \
        if (b && nesterov) sgd_tensor(w, g, b, sizes[t], keys[t], lr, momentum, 1, weight_decay, grad_scale, D, S); \
        else if (b) sgd_tensor(w, g, b, sizes[t], keys[t], lr, momentum, 0, weight_decay, grad_scale, D, S);        \
        else sgd_tensor(w, g, 0, sizes[t], keys[t], lr, momentum, 0, weight_decay, grad_scale, D, S);               \
    } while (0)
        SPECIALIZED(SGD, dtype, stochastic);
#undef SGD
    }
}

ALWAYS_INLINE void adam_amax_tensor(const uint16_t *g, const uint16_t *m, const uint16_t *v, int64_t size,
                                    float read_m, float read_v, float beta1, float beta2, float one_minus_beta1,
                                    float one_minus_beta2, float grad_scale, float *amax, int dtype) {
    float top_m = 0.0f, top_v = 0.0f;
    for (int64_t i = 0; i < size; i++) {
        float grad = load16(g, i, dtype) / grad_scale;
        float avg = load16(m, i, dtype) * read_m * beta1 + grad * one_minus_beta1;
        float avg_sq = load16(v, i, dtype) * read_v * beta2 + one_minus_beta2 * grad * grad;
        /* fmaxf's result, NaN ignored, in a form the vectorizer takes as a max reduction */
        float abs_m = fabsf(avg), abs_v = fabsf(avg_sq);
        top_m = abs_m > top_m ? abs_m : top_m;
        top_v = abs_v > top_v ? abs_v : top_v;
    }
    amax[0] = top_m;
    amax[1] = top_v;
}

/* Adam, first pass: the largest |new moment| of each tensor (the per-tensor scales of pass two). */
void lowmem_adam_amax(int64_t count, const int64_t *grads, const int64_t *exp_avgs, const int64_t *exp_avg_sqs,
                      const int64_t *sizes, const int64_t *m_scales, const int64_t *v_scales, int dtype,
                      float beta1, float beta2,
                      float one_minus_beta1, float one_minus_beta2, float grad_scale, float *amax) {
    for (int64_t t = 0; t < count; t++) {
        const uint16_t *g = (const uint16_t *)grads[t], *m = (const uint16_t *)exp_avgs[t];
        const uint16_t *v = (const uint16_t *)exp_avg_sqs[t];
        float read_m = pow2(-(int)*(const float *)m_scales[t]), read_v = pow2(-(int)*(const float *)v_scales[t]);
#define AMAX(D, S) adam_amax_tensor(g, m, v, sizes[t], read_m, read_v, beta1, beta2, one_minus_beta1, \
                                     one_minus_beta2, grad_scale, amax + 2 * t, D)
        SPECIALIZED(AMAX, dtype, 0);
#undef AMAX
    }
}

/* The exponent k that puts max |x| in [2^14, 2^15): FP16's top binade (reference.moment_log2_scale). */
static inline float moment_log2_scale(float top) {
    int exponent;
    frexpf(top, &exponent);
    int k = 15 - exponent;
    return (float)(k < -126 ? -126 : (k > 126 ? 126 : k));
}

ALWAYS_INLINE void adam_tensor(uint16_t *w, const uint16_t *g, uint16_t *m, uint16_t *v, int64_t size,
                               uint32_t key, float read_m, float read_v, float write_m, float write_v,
                               float step_size, float beta1, float beta2, float one_minus_beta1,
                               float one_minus_beta2, float eps, int decays, float decay, float grad_scale,
                               int dtype, int stochastic) {
    for (int64_t i = 0; i < size; i++) {
        float grad = load16(g, i, dtype) / grad_scale;
        float avg = load16(m, i, dtype) * read_m * beta1 + grad * one_minus_beta1;
        float avg_sq = load16(v, i, dtype) * read_v * beta2 + one_minus_beta2 * grad * grad;
        float weight = load16(w, i, dtype);
        if (decays) weight = weight * decay;
        weight = weight + -step_size * (avg / (sqrtf(avg_sq) + eps));
        m[i] = round_nearest(avg * write_m, dtype);
        v[i] = round_nearest(avg_sq * write_v, dtype);
        w[i] = store_weight(weight, stochastic, key, i, dtype);
    }
}

/* Adam, second pass: new moments (stored scaled per tensor) and weights. */
void lowmem_adam(int64_t count, const int64_t *weights, const int64_t *grads, const int64_t *exp_avgs,
                 const int64_t *exp_avg_sqs, const int64_t *sizes, const int64_t *m_scales,
                 const int64_t *v_scales, const float *amax,
                 const float *step_sizes, const uint32_t *keys, int dtype, float beta1, float beta2,
                 float one_minus_beta1, float one_minus_beta2, float eps, int decays, float decay, float grad_scale,
                 int stochastic) {
    for (int64_t t = 0; t < count; t++) {
        uint16_t *w = (uint16_t *)weights[t], *m = (uint16_t *)exp_avgs[t], *v = (uint16_t *)exp_avg_sqs[t];
        const uint16_t *g = (const uint16_t *)grads[t];
        float *m_scale = (float *)m_scales[t], *v_scale = (float *)v_scales[t];
        float read_m = pow2(-(int)*m_scale), read_v = pow2(-(int)*v_scale);
        float scale_m = moment_log2_scale(amax[2 * t]), scale_v = moment_log2_scale(amax[2 * t + 1]);
        float write_m = pow2((int)scale_m), write_v = pow2((int)scale_v);
        float step_size = step_sizes[t];
#define ADAM(D, S)                                                                                         \
    do {                                                                                                   \
        if (decays) adam_tensor(w, g, m, v, sizes[t], keys[t], read_m, read_v, write_m, write_v, step_size,  \
                                beta1, beta2, one_minus_beta1, one_minus_beta2, eps, 1, decay, grad_scale, D, S); \
        else adam_tensor(w, g, m, v, sizes[t], keys[t], read_m, read_v, write_m, write_v, step_size, beta1,  \
                         beta2, one_minus_beta1, one_minus_beta2, eps, 0, decay, grad_scale, D, S);          \
    } while (0)
        SPECIALIZED(ADAM, dtype, stochastic);
#undef ADAM
        *m_scale = scale_m;
        *v_scale = scale_v;
    }
}

/* ---------------------------------------------------------------------------------------------
 * 8- and 4-bit optimizer state (lowmem/kernels/quantized.py defines the arithmetic; codebooks.py
 * the maps). State is blockwise quantized: per block of `block` values one FP32 scale (the block's
 * largest magnitude) and per value the code of one of the two map entries around value / scale,
 * chosen stochastically (unbiased; counter-based random bits from the tensor's state key). Weights
 * and gradients are FP32, FP16 or BF16. A block's new state is computed in FP32 into a stack
 * buffer, the weights updated from it, then the block is quantized: no allocation.
 */
#define SECOND_MOMENT_SALT 0x5851f42du /* quantized.SECOND_MOMENT_SALT: the second moment's key */
#define MAX_BLOCK 4096

static inline float load_any(const void *p, int64_t i, int dtype) {
    return dtype == FP32 ? ((const float *)p)[i] : load16((const uint16_t *)p, i, dtype);
}

static inline void store_any(void *p, int64_t i, float w, int stochastic, uint32_t key, int dtype) {
    if (dtype == FP32) ((float *)p)[i] = w;
    else ((uint16_t *)p)[i] = store_weight(w, stochastic, key, i, dtype);
}

static inline int read_code(const uint8_t *codes, int64_t i, int bits) {
    return bits == 8 ? codes[i] : (codes[i >> 1] >> ((i & 1) * 4)) & 15;
}

/* The number of midpoints below x (a binary search over the 2^bits - 1 ascending midpoints). */
static inline int find_code(float x, const float *mids, int bits) {
    int code = 0;
    for (int step = 1 << (bits - 1); step > 0; step >>= 1)
        if (mids[code + step - 1] < x) code += step;
    return code;
}

/* The code of normalised x rounded stochastically between the map entries around it: up from the
 * lower one with probability (x - lower) / (upper - lower); r24 uniform in [0, 2^24). */
static inline int round_code(float x, const float *table, const float *mids, int bits, uint32_t r24) {
    int code = find_code(x, mids, bits); /* the nearest entry */
    int lower = x < table[code] ? code - 1 : code;
    if (lower == (1 << bits) - 1) return lower;
    float gap = table[lower + 1] - table[lower];
    return lower + (((float)r24 * 0x1p-24f) * gap < x - table[lower] ? 1 : 0);
}

/* Quantize x[0 .. count) (values first .. first+count-1 of the state; first a multiple of the block
 * size, so even) into codes and *scale, rounding with the random bits of `key`. Unsigned maps: a
 * positive value never takes code 0. */
static void quantize_block(const float *x, int64_t count, int64_t first, uint8_t *codes, float *scale,
                           const float *table, const float *mids, int bits, int is_signed, uint32_t key) {
    float top = 0.0f;
    for (int64_t i = 0; i < count; i++) top = fmaxf(top, fabsf(x[i]));
    *scale = top;
    int previous = 0;
    for (int64_t i = 0; i < count; i++) {
        int code = round_code(top > 0.0f ? x[i] / top : 0.0f, table, mids, bits, random24(key, (uint32_t)(first + i)));
        if (!is_signed && code == 0 && x[i] > 0.0f) code = 1;
        if (bits == 8) codes[first + i] = (uint8_t)code;
        else if (i & 1) codes[(first + i) >> 1] = (uint8_t)(previous | (code << 4));
        else previous = code;
    }
    if (bits == 4 && (count & 1)) codes[(first + count) >> 1] = (uint8_t)previous;
}

void lowmem_sgd_q(int64_t count, const int64_t *weights, const int64_t *grads, const int64_t *codes,
                  const int64_t *scales, const int64_t *sizes, const uint32_t *keys, const uint32_t *state_keys,
                  int dtype, int bits, int64_t block, const float *table, const float *mids, float lr,
                  float momentum, int nesterov, float weight_decay, float grad_scale, int stochastic) {
    float buffer[MAX_BLOCK];
    for (int64_t t = 0; t < count; t++) {
        void *w = (void *)weights[t];
        const void *g = (const void *)grads[t];
        uint8_t *c = (uint8_t *)codes[t];
        float *s = (float *)scales[t];
        for (int64_t first = 0; first < sizes[t]; first += block) {
            int64_t length = sizes[t] - first < block ? sizes[t] - first : block;
            float scale = s[first / block];
            for (int64_t i = 0; i < length; i++) {
                int64_t e = first + i;
                float weight = load_any(w, e, dtype);
                float grad = load_any(g, e, dtype) / grad_scale;
                if (weight_decay != 0.0f) grad = grad + weight * weight_decay;
                float b = table[read_code(c, e, bits)] * scale * momentum + grad;
                float update = nesterov ? grad + b * momentum : b;
                buffer[i] = b;
                store_any(w, e, weight + update * -lr, stochastic, keys[t], dtype);
            }
            quantize_block(buffer, length, first, c, s + first / block, table, mids, bits, 1, state_keys[t]);
        }
    }
}

void lowmem_adam_q(int64_t count, const int64_t *weights, const int64_t *grads, const int64_t *m_codes,
                   const int64_t *m_scales, const int64_t *v_codes, const int64_t *v_scales, const int64_t *sizes,
                   const float *step_sizes, const uint32_t *keys, const uint32_t *state_keys, int dtype, int bits,
                   int64_t block, const float *m_table, const float *m_mids, const float *v_table, const float *v_mids,
                   float beta1, float beta2, float one_minus_beta1, float one_minus_beta2, float eps, int decays,
                   float decay, float grad_scale, int stochastic) {
    float m_buffer[MAX_BLOCK], v_buffer[MAX_BLOCK];
    for (int64_t t = 0; t < count; t++) {
        void *w = (void *)weights[t];
        const void *g = (const void *)grads[t];
        uint8_t *mc = (uint8_t *)m_codes[t], *vc = (uint8_t *)v_codes[t];
        float *ms = (float *)m_scales[t], *vs = (float *)v_scales[t];
        float step_size = step_sizes[t];
        for (int64_t first = 0; first < sizes[t]; first += block) {
            int64_t length = sizes[t] - first < block ? sizes[t] - first : block;
            float m_scale = ms[first / block], v_scale = vs[first / block];
            for (int64_t i = 0; i < length; i++) {
                int64_t e = first + i;
                float grad = load_any(g, e, dtype) / grad_scale;
                float avg = m_table[read_code(mc, e, bits)] * m_scale * beta1 + grad * one_minus_beta1;
                float avg_sq = v_table[read_code(vc, e, bits)] * v_scale * beta2 + one_minus_beta2 * grad * grad;
                float weight = load_any(w, e, dtype);
                if (decays) weight = weight * decay;
                weight = weight + -step_size * (avg / (sqrtf(avg_sq) + eps));
                m_buffer[i] = avg;
                v_buffer[i] = avg_sq;
                store_any(w, e, weight, stochastic, keys[t], dtype);
            }
            quantize_block(m_buffer, length, first, mc, ms + first / block, m_table, m_mids, bits, 1, state_keys[t]);
            quantize_block(v_buffer, length, first, vc, vs + first / block, v_table, v_mids, bits, 0,
                           state_keys[t] ^ SECOND_MOMENT_SALT);
        }
    }
}

/* --- compact sparse weights (lowmem.techniques.compact) ------------------------------------------
 * Active entry i of row r sits at flat position r * row + columns[i] (row_starts: CSR over rows of
 * ``row`` entries), positions strictly increasing. The copies move bits: any dtype of 2, 4 or 8 bytes.
 *
 * The dense weight lies in memory contiguously (spatial <= 1) or channels-last: a weight
 * [outer, inner, spatial] stored as [outer, spatial, inner] (a compiled convolution's layout on a CPU),
 * where position p = o * plane + (c * spatial + s), plane = inner * spatial, sits at
 * o * plane + (s * inner + c). The offset within a plane comes from a table of one plane's (made per
 * call: a plane is small, a weight has many), the plane's start from a cursor, found again by a
 * division only where a position lies outside the cursor's plane. -1 where the table cannot be made
 * (nothing written): the caller copies by another way. */

typedef struct { int64_t plane, start; const int32_t *within; } layout_cursor;

static int32_t *plane_offsets(int64_t inner, int64_t spatial) {
    if (inner * spatial > INT32_MAX) return NULL; /* offsets within a plane are int32 */
    int32_t *within = malloc((size_t)(inner * spatial) * sizeof(int32_t));
    if (within)
        for (int64_t c = 0; c < inner; c++)
            for (int64_t s = 0; s < spatial; s++) within[c * spatial + s] = (int32_t)(s * inner + c);
    return within;
}

ALWAYS_INLINE int64_t laid_out(layout_cursor *k, int64_t p) {
    if (p < k->start || p - k->start >= k->plane) k->start = p / k->plane * k->plane;
    return k->start + k->within[p - k->start];
}

#define COPY_LAID_OUT(T, target, source)                                                            \
    if (within == NULL) {                                                                           \
        for (int64_t r = 0; r < rows; r++)                                                          \
            for (int64_t i = row_starts[r]; i < row_starts[r + 1]; i++) {                           \
                int64_t p = r * row + columns[i];                                                   \
                target = source;                                                                    \
            }                                                                                       \
    } else {                                                                                        \
        layout_cursor cursor = {inner * spatial, 0, within};                                        \
        for (int64_t r = 0; r < rows; r++)                                                          \
            for (int64_t i = row_starts[r]; i < row_starts[r + 1]; i++) {                           \
                int64_t p = laid_out(&cursor, r * row + columns[i]);                                \
                target = source;                                                                    \
            }                                                                                       \
    }

int lowmem_densify(void *dense, const void *values, const int16_t *columns, const int64_t *row_starts, int64_t rows,
                   int64_t numel, int64_t row, int element_size, int64_t inner, int64_t spatial) {
    int32_t *within = spatial > 1 ? plane_offsets(inner, spatial) : NULL;
    if (spatial > 1 && within == NULL) return -1;
    memset(dense, 0, (size_t)(numel * element_size));
    if (element_size == 2) { COPY_LAID_OUT(uint16_t, ((uint16_t *)dense)[p], ((const uint16_t *)values)[i]) }
    else if (element_size == 4) { COPY_LAID_OUT(uint32_t, ((uint32_t *)dense)[p], ((const uint32_t *)values)[i]) }
    else { COPY_LAID_OUT(uint64_t, ((uint64_t *)dense)[p], ((const uint64_t *)values)[i]) }
    free(within);
    return 0;
}

int lowmem_gather(void *out, const void *dense, const int16_t *columns, const int64_t *row_starts, int64_t rows,
                  int64_t row, int element_size, int64_t inner, int64_t spatial) {
    int32_t *within = spatial > 1 ? plane_offsets(inner, spatial) : NULL;
    if (spatial > 1 && within == NULL) return -1;
    if (element_size == 2) { COPY_LAID_OUT(uint16_t, ((uint16_t *)out)[i], ((const uint16_t *)dense)[p]) }
    else if (element_size == 4) { COPY_LAID_OUT(uint32_t, ((uint32_t *)out)[i], ((const uint32_t *)dense)[p]) }
    else { COPY_LAID_OUT(uint64_t, ((uint64_t *)out)[i], ((const uint64_t *)dense)[p]) }
    free(within);
    return 0;
}

/* Saved activations quantized for backward (lowmem/techniques/compression.py, whose torch version is
 * the definition, operation for operation): groups of ACTIVATION_GROUP elements, each with its minimum
 * and step (FP32; the last group padded with its last value), codes floor((x - min) * (1 / step) + u)
 * clamped to [0, 2^bits - 1], u = (byte + 0.5) / 256 with the byte (e mod 4) of fmix32 over the word
 * e / 4 of element e, packed 8 / bits to a byte, the first in the low bits. Groups
 * [first_group, first_group + groups) of a tensor of `count` elements. */
#define ACTIVATION_GROUP 256

/* Specialized per width and dtype (constants inside the loops, as SPECIALIZED above): vectorized. */
#define FOR_WIDTH_AND_DTYPE(call, bits, dtype)                                                     \
    do {                                                                                            \
        if ((dtype) == FP32) { if ((bits) == 8) call(8, FP32); else if ((bits) == 4) call(4, FP32); else call(2, FP32); } \
        else if ((dtype) == BF16) { if ((bits) == 8) call(8, BF16); else if ((bits) == 4) call(4, BF16); else call(2, BF16); } \
        else { if ((bits) == 8) call(8, FP16); else if ((bits) == 4) call(4, FP16); else call(2, FP16); } \
    } while (0)

ALWAYS_INLINE void quantize_groups(int64_t count, const void *x, uint32_t key, int64_t first_group, int64_t groups,
                                   uint8_t *codes, float *lows, float *steps, const int bits, const int dtype) {
    const int levels = (1 << bits) - 1, per_byte = 8 / bits;
    float v[ACTIVATION_GROUP], u[ACTIVATION_GROUP];
    uint8_t q[ACTIVATION_GROUP];
    for (int64_t g = first_group; g < first_group + groups; g++) {
        int64_t start = g * ACTIVATION_GROUP;
        int64_t n = count - start < ACTIVATION_GROUP ? count - start : ACTIVATION_GROUP;
        if (n == ACTIVATION_GROUP) {
            for (int i = 0; i < ACTIVATION_GROUP; i++) v[i] = load_any(x, start + i, dtype);
        } else {
            for (int64_t i = 0; i < n; i++) v[i] = load_any(x, start + i, dtype);
            for (int64_t i = n; i < ACTIVATION_GROUP; i++) v[i] = v[n - 1];
        }
        float low = v[0], high = v[0];
        for (int i = 1; i < ACTIVATION_GROUP; i++) {
            low = v[i] < low ? v[i] : low;
            high = v[i] > high ? v[i] : high;
        }
        float step = (high - low) / (float)levels;
        float inv = step > 0.0f ? 1.0f / step : 0.0f;
        lows[g] = low;
        steps[g] = step;
        for (int i = 0; i < ACTIVATION_GROUP / 4; i++) {
            uint32_t word = fmix32(key ^ ((uint32_t)((start >> 2) + i) * 0x27d4eb2fu));
            for (int j = 0; j < 4; j++) u[4 * i + j] = ((float)((word >> (8 * j)) & 255u) + 0.5f) * 0x1p-8f;
        }
        for (int i = 0; i < ACTIVATION_GROUP; i++) {
            float s = floorf((v[i] - low) * inv + u[i]);
            s = s < 0.0f ? 0.0f : s;
            s = s > (float)levels ? (float)levels : s;
            q[i] = (uint8_t)s;
        }
        uint8_t *out = codes + start * bits / 8;
        for (int i = 0; i < ACTIVATION_GROUP / per_byte; i++) {
            uint8_t byte = 0;
            for (int j = 0; j < per_byte; j++) byte |= (uint8_t)(q[i * per_byte + j] << (j * bits));
            out[i] = byte;
        }
    }
}

/* Saved activations quantized for backward (lowmem/techniques/compression.py, whose torch version is
 * the definition, operation for operation): groups of ACTIVATION_GROUP elements, each with its minimum
 * and step (FP32; the last group padded with its last value), codes floor((x - min) * (1 / step) + u)
 * clamped to [0, 2^bits - 1], u = (byte + 0.5) / 256 with the byte (e mod 4) of fmix32 over the word
 * e / 4 of element e, packed 8 / bits to a byte, the first in the low bits. Groups
 * [first_group, first_group + groups) of a tensor of `count` elements. */
void lowmem_quantize_activation(int64_t count, const void *x, int dtype, int bits, uint32_t key, int64_t first_group,
                                int64_t groups, uint8_t *codes, float *lows, float *steps) {
#define QUANTIZE(B, D) quantize_groups(count, x, key, first_group, groups, codes, lows, steps, B, D)
    FOR_WIDTH_AND_DTYPE(QUANTIZE, bits, dtype);
#undef QUANTIZE
}

ALWAYS_INLINE void dequantize_groups(int64_t count, const uint8_t *codes, const float *lows, const float *steps,
                                     void *out, int64_t first_group, int64_t groups, const int bits, const int dtype) {
    const int mask = (1 << bits) - 1, per_byte = 8 / bits;
    float value[ACTIVATION_GROUP];
    for (int64_t g = first_group; g < first_group + groups; g++) {
        int64_t start = g * ACTIVATION_GROUP;
        int64_t n = count - start < ACTIVATION_GROUP ? count - start : ACTIVATION_GROUP;
        const uint8_t *in = codes + start * bits / 8;
        float low = lows[g], step = steps[g];
        for (int i = 0; i < ACTIVATION_GROUP / per_byte; i++)
            for (int j = 0; j < per_byte; j++)
                value[i * per_byte + j] = (float)((in[i] >> (j * bits)) & mask) * step + low;
        for (int64_t i = 0; i < n; i++) {
            if (dtype == FP32) ((float *)out)[start + i] = value[i];
            else ((uint16_t *)out)[start + i] = round_nearest(value[i], dtype);
        }
    }
}

/* The values back, (float)code * step + min (a multiply, then an add), stored in dtype (rounded to
 * nearest even); elements of groups [first_group, first_group + groups) below `count`. */
void lowmem_dequantize_activation(int64_t count, const uint8_t *codes, const float *lows, const float *steps, int bits,
                                  void *out, int dtype, int64_t first_group, int64_t groups) {
#define DEQUANTIZE(B, D) dequantize_groups(count, codes, lows, steps, out, first_group, groups, B, D)
    FOR_WIDTH_AND_DTYPE(DEQUANTIZE, bits, dtype);
#undef DEQUANTIZE
}

/* BatchNorm's training-mode output recomputed from kept per-channel statistics, then ReLU
 * (lowmem/techniques/checkpointing.py, whose torch version is the definition): out = relu(round(
 * fma(x, scale[c], shift[c]))) over a contiguous (batch, channels, plane) tensor, x and out of one
 * dtype (FP16, BF16 or FP32), the multiply-add rounded once to FP32 as the CPU BN kernel rounds it,
 * then once to the dtype. ReLU gives +0 for every value not above 0; NaN stays NaN. Examples
 * [first, first + count). */
#define NORM_RELU(dtype)                                                                            \
    for (int64_t n = first; n < first + count; n++)                                                 \
        for (int64_t c = 0; c < channels; c++) {                                                    \
            const float a = scale[c], b = shift[c];                                                 \
            const int64_t base = (n * channels + c) * plane;                                        \
            for (int64_t i = base; i < base + plane; i++) {                                         \
                if (dtype == FP32) {                                                                \
                    float v = fmaf(((const float *)x)[i], a, b);                                    \
                    ((float *)out)[i] = v > 0.0f || v != v ? v : 0.0f;                              \
                } else {                                                                            \
                    uint16_t r = round_nearest(fmaf(load16((const uint16_t *)x, i, dtype), a, b), dtype); \
                    float v = load16(&r, 0, dtype);                                                 \
                    ((uint16_t *)out)[i] = v > 0.0f || v != v ? r : 0;                              \
                }                                                                                   \
            }                                                                                       \
        }

void lowmem_norm_relu(void *out, const void *x, const float *scale, const float *shift, int64_t channels,
                      int64_t plane, int dtype, int64_t first, int64_t count) {
    if (dtype == FP32) { NORM_RELU(FP32) }
    else if (dtype == BF16) { NORM_RELU(BF16) }
    else { NORM_RELU(FP16) }
}
