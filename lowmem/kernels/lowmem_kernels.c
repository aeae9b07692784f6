/* lowmem's fused optimizer updates for 16-bit tensors on the CPU (lowmem/kernels/cpu.py builds and
 * loads this file). One call updates a whole list of tensors: weights, gradients and optimizer
 * state stay in FP16 or BF16, every element is computed in FP32 registers, nothing is allocated.
 *
 * The arithmetic is lowmem/kernels/reference.py's, operation for operation, in the same order, each
 * one correctly rounded FP32 operation and none fused: built with -ffp-contract=off, `a + b * c` is a
 * multiply and an add here as in the reference, whatever the CPU (see that file for the definitions;
 * lowmem/kernels/triton_kernels.py is the CUDA twin).
 * Tensors are passed as arrays of addresses (int64) with their element counts.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FP16 = 0, BF16 = 1 };

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

void lowmem_sgd(int64_t count, const int64_t *weights, const int64_t *grads, const int64_t *momenta,
                const int64_t *sizes, const uint32_t *keys, int dtype, float lr, float momentum, int nesterov,
                float weight_decay, float grad_scale, int stochastic) {
    for (int64_t t = 0; t < count; t++) {
        uint16_t *w = (uint16_t *)weights[t];
        const uint16_t *g = (const uint16_t *)grads[t];
        uint16_t *b = momentum != 0.0f ? (uint16_t *)momenta[t] : 0;
        for (int64_t i = 0; i < sizes[t]; i++) {
            float weight = load16(w, i, dtype);
            float grad = load16(g, i, dtype) / grad_scale;
            if (weight_decay != 0.0f) grad = grad + weight * weight_decay;
            float update = grad;
            if (b) {
                float buffer = load16(b, i, dtype) * momentum + grad;
                update = nesterov ? grad + buffer * momentum : buffer;
                b[i] = round_nearest(buffer, dtype);
            }
            w[i] = store_weight(weight + update * -lr, stochastic, keys[t], i, dtype);
        }
    }
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
        float top_m = 0.0f, top_v = 0.0f;
        for (int64_t i = 0; i < sizes[t]; i++) {
            float grad = load16(g, i, dtype) / grad_scale;
            float avg = load16(m, i, dtype) * read_m * beta1 + grad * one_minus_beta1;
            float avg_sq = load16(v, i, dtype) * read_v * beta2 + one_minus_beta2 * grad * grad;
            top_m = fmaxf(top_m, fabsf(avg));
            top_v = fmaxf(top_v, fabsf(avg_sq));
        }
        amax[2 * t] = top_m;
        amax[2 * t + 1] = top_v;
    }
}

/* The exponent k that puts max |x| in [2^14, 2^15): FP16's top binade (reference.moment_log2_scale). */
static inline float moment_log2_scale(float top) {
    int exponent;
    frexpf(top, &exponent);
    int k = 15 - exponent;
    return (float)(k < -126 ? -126 : (k > 126 ? 126 : k));
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
        for (int64_t i = 0; i < sizes[t]; i++) {
            float grad = load16(g, i, dtype) / grad_scale;
            float avg = load16(m, i, dtype) * read_m * beta1 + grad * one_minus_beta1;
            float avg_sq = load16(v, i, dtype) * read_v * beta2 + one_minus_beta2 * grad * grad;
            float weight = load16(w, i, dtype);
            if (decays) weight = weight * decay;
            weight = weight + -step_size * (avg / (sqrtf(avg_sq) + eps));
            m[i] = round_nearest(avg * write_m, dtype);
            v[i] = round_nearest(avg_sq * write_v, dtype);
            w[i] = store_weight(weight, stochastic, keys[t], i, dtype);
        }
        *m_scale = scale_m;
        *v_scale = scale_v;
    }
}
