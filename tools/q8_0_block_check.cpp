// Checks fa_q8_0_block (patch flash-attn-train-cuda-kv-q8_0-ahead) on the host against the per-element definition
// (the int8 times the f16 scale in f32, then fa_tf32_bits), over random rows and the special scales (zeros,
// subnormals, Inf, NaN): bitwise as the tensor cores read a TF32 operand (its 13 low bits ignored), NaN for NaN, and
// a zero for a zero (of either sign: a zero scale's zeros take the scale's sign, the int8's sign aside).
// Run: bash tools/q8_0_block_check.sh [the patched ggml tree] (tests/test_q8_0_block.py does)
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cmath>
#include <random>
#include <type_traits>
#include <vector>
#define __device__
#define __forceinline__ inline
struct float4 { float x, y, z, w; };
static float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t s) { // PTX prmt default mode
    uint64_t x = ((uint64_t) b << 32) | a; uint32_t r = 0;
    for (int i = 0; i < 4; ++i) { int sel = (s >> (4*i)) & 7; r |= (uint32_t) ((x >> (8*sel)) & 0xFF) << (8*i); }
    return r;
}
typedef uint16_t half_t;
static half_t __ushort_as_half(uint16_t h) { return h; }
static float __half2float(half_t h) { _Float16 f; memcpy(&f, &h, 2); return (float) f; }
#include "blk.inc"
static float tf32_bits(float x) { uint32_t u = __float_as_uint(x); return (u & 0x7F800000u) == 0x7F800000u ? x : __uint_as_float((u + 0x1000u) & 0xFFFFE000u); }
int main() {
    std::mt19937 rng(1);
    const int NB = 9; long checked = 0, bad = 0;
    std::vector<uint16_t> specials = {0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x3555, 0x1234};
    for (int trial = 0; trial < 400000; ++trial) {
        uint8_t row[34*NB + 16];
        for (auto & c : row) c = rng();
        for (int b = 0; b < NB; ++b) {
            uint16_t d = trial % 3 == 0 ? specials[rng() % specials.size()] : (uint16_t) rng();
            memcpy(row + 34*b, &d, 2);
        }
        for (int b = 0; b < NB; ++b) {
            uint32_t w[9];
            memcpy(w, row + (34*b & ~3), 36);
            float4 x[8];
            fa_q8_0_block(w, b & 1, x);
            uint16_t dh; memcpy(&dh, row + 34*b, 2);
            const float d = __half2float(dh);
            for (int e = 0; e < 32; ++e) {
                const uint32_t ref = __float_as_uint(tf32_bits((float) (int8_t) row[34*b + 2 + e] * d));
                const uint32_t got = __float_as_uint(((float *) x)[e]);
                const uint32_t seen = (got & 0x7F800000u) == 0x7F800000u ? got : got & 0xFFFFE000u; // as a TF32 operand
                ++checked;
                if (ref != seen && !(std::isnan(__uint_as_float(ref)) && std::isnan(__uint_as_float(seen)))
                        && !(d == 0.0f && __uint_as_float(ref) == 0.0f && __uint_as_float(seen) == 0.0f)) {
                    if (bad++ < 10) printf("MISMATCH b=%d e=%d d=%04x q=%d ref=%08x got=%08x\n", b, e, dh, (int) (int8_t) row[34*b+2+e], ref, got);
                }
            }
        }
    }
    printf("checked %ld values, %ld mismatches\n", checked, bad);
    return bad != 0;
}
