#version 450
// y[t, o] (+)= Σ_i W[o, i] · x[t, i]: one workgroup per (output o, row t), the same code and the
// same reduction order whatever the number of rows (a verify row equals the decode row bit for bit).
// The weights are the file's blocks re-tiled at load: codes [n_out, nblk, WORDS] u32 (the block's
// code bytes as little-endian words, unchanged) and scales [n_out, nblk] f32.
//   QT 0  Q1_0:       block 128, 4 words; element j is bit j of the block  → w = bit ? +d : −d
//   QT 1  Q2_0 g128:  block 128, 8 words; element j is bits 2j..2j+1       → w = (c − 1)·d
//   QT 2  Q2_0 g64:   block 64,  4 words; same codes
//   QT 3  f32:        codes hold the f32 row-major matrix, no scales
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;
layout(push_constant, std430) uniform P {
    U32 codes;
    F32 scales;
    F32 x;      // [n, n_in]
    F32 y;      // [n, n_out]
    uint groups; // n_out · n
    uint n_in;
    uint n_out;
    uint acc;   // 1: y += result
} p;
shared float red[64];

#if QT == 0
#define BLK 128u
#define WORDS 4u
#elif QT == 1
#define BLK 128u
#define WORDS 8u
#elif QT == 2
#define BLK 64u
#define WORDS 4u
#endif

void main() {
    uint g = group_id();
    if (g >= p.groups) return;
    uint tid = gl_LocalInvocationID.x;
    uint o = g % p.n_out;
    uint t = g / p.n_out;
    uint xb = t * p.n_in;
    float acc = 0.0;
#if QT == 3
    uint wb = o * p.n_in;
    for (uint i = tid; i < p.n_in; i += 64) acc += uintBitsToFloat(p.codes.v[wb + i]) * p.x.v[xb + i];
#else
    uint nblk = p.n_in / BLK;
    for (uint b = tid; b < nblk; b += 64) {
        uint cw = (o * nblk + b) * WORDS;
        uint xo = xb + b * BLK;
        float s = 0.0;
        for (uint w = 0; w < WORDS; w++) {
            uint bits = p.codes.v[cw + w];
#if QT == 0
            for (uint i = 0; i < 32; i++) {
                float xv = p.x.v[xo + w * 32 + i];
                s += ((bits >> i) & 1u) != 0u ? xv : -xv;
            }
#else
            for (uint i = 0; i < 16; i++) {
                float c = float(int((bits >> (2 * i)) & 3u) - 1);
                s += c * p.x.v[xo + w * 16 + i];
            }
#endif
        }
        acc += p.scales.v[o * nblk + b] * s;
    }
#endif
    red[tid] = acc;
    barrier();
    for (uint s = 32; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        barrier();
    }
    if (tid == 0) {
        uint yi = t * p.n_out + o;
        p.y.v[yi] = p.acc != 0 ? p.y.v[yi] + red[0] : red[0];
    }
}
