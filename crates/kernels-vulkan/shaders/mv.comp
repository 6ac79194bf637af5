#version 450
// y[t, o] (+)= Σ_i W[o, i] · x[t, i]. A workgroup of 64 invocations takes 4 consecutive outputs of
// one row t: 16 invocations per output, invocation i of an output walking its blocks i, i + 16, …
// with 16-byte loads, then a fixed-order tree over the 16 partials in shared memory. The code and
// the order for (o, t) do not depend on the number of rows (a verify row equals the decode row bit
// for bit). The weights are the file's blocks re-tiled at load: codes [n_out, nblk, WORDS] u32 (the
// block's code bytes as little-endian words, unchanged) and scales [n_out, nblk] f32.
//   QT 0  Q1_0:       block 128, 4 words; element j is bit j of the block  → w = bit ? +d : −d
//   QT 1  Q2_0 g128:  block 128, 8 words; element j is bits 2j..2j+1       → w = (c − 1)·d
//   QT 2  Q2_0 g64:   block 64,  4 words; same codes
//   QT 3  f32:        codes hold the f32 row-major matrix (blocks of 4), no scales
// x rows and the code plane must be 16-byte aligned (n_in a multiple of 4; the host checks).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4 { vec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4 { uvec4 v[]; };
layout(local_size_x = 64) in;
layout(push_constant, std430) uniform P {
    U4 codes;
    F32 scales;
    V4 x;       // [n, n_in]
    F32 y;      // [n, n_out]
    uint groups; // ceil(n_out / 4) · n
    uint n_in;
    uint n_out;
    uint acc;   // 1: y += result
} p;
shared float red[64];

#if QT == 0
#define BLK 128u
#define QW 1u
#elif QT == 1
#define BLK 128u
#define QW 2u
#elif QT == 2
#define BLK 64u
#define QW 1u
#else
#define BLK 4u
#define QW 1u
#endif

// Σ_j w_j x_j over one 32-element word of Q1 bits (x as 8 vec4 starting at xv).
float q1_word(uint bits, uint xv) {
    float s = 0.0;
    for (uint k = 0; k < 8; k++) {
        vec4 xx = p.x.v[xv + k];
        uint b = bits >> (4 * k);
        s += ((b & 1u) != 0u ? xx.x : -xx.x) + ((b & 2u) != 0u ? xx.y : -xx.y)
           + ((b & 4u) != 0u ? xx.z : -xx.z) + ((b & 8u) != 0u ? xx.w : -xx.w);
    }
    return s;
}

// Σ_j (c_j − 1) x_j over one 16-element word of Q2 codes (x as 4 vec4 starting at xv).
float q2_word(uint bits, uint xv) {
    float s = 0.0;
    for (uint k = 0; k < 4; k++) {
        vec4 xx = p.x.v[xv + k];
        uint b = bits >> (8 * k);
        vec4 c = vec4(float(b & 3u), float((b >> 2) & 3u), float((b >> 4) & 3u), float((b >> 6) & 3u)) - 1.0;
        s += c.x * xx.x + c.y * xx.y + c.z * xx.z + c.w * xx.w;
    }
    return s;
}

void main() {
    uint g = group_id();
    if (g >= p.groups) return;
    uint tid = gl_LocalInvocationID.x;
    uint lane = tid & 15u;
    uint per_row = (p.n_out + 3u) / 4u;
    uint t = g / per_row;
    uint o = (g % per_row) * 4u + (tid >> 4);
    float acc = 0.0;
    if (o < p.n_out) {
        uint nblk = p.n_in / BLK;
        uint xb = t * (p.n_in / 4u);  // in vec4
        for (uint b = lane; b < nblk; b += 16u) {
            uint xo = xb + b * (BLK / 4u);
#if QT == 3
            vec4 w = uintBitsToFloat(p.codes.v[o * nblk + b]);
            vec4 xx = p.x.v[xo];
            acc += w.x * xx.x + w.y * xx.y + w.z * xx.z + w.w * xx.w;
#else
            float s = 0.0;
            for (uint q = 0; q < QW; q++) {
                uvec4 c = p.codes.v[(o * nblk + b) * QW + q];
#if QT == 0
                s += q1_word(c.x, xo) + q1_word(c.y, xo + 8u) + q1_word(c.z, xo + 16u) + q1_word(c.w, xo + 24u);
#else
                uint xq = xo + q * 16u;
                s += q2_word(c.x, xq) + q2_word(c.y, xq + 4u) + q2_word(c.z, xq + 8u) + q2_word(c.w, xq + 12u);
#endif
            }
            acc += p.scales.v[o * nblk + b] * s;
#endif
        }
    }
    red[tid] = acc;
    barrier();
    for (uint s = 8u; s > 0u; s >>= 1) {
        if (lane < s) red[tid] += red[tid + s];
        barrier();
    }
    if (lane == 0u && o < p.n_out) {
        uint yi = t * p.n_out + o;
        p.y.v[yi] = p.acc != 0u ? p.y.v[yi] + red[tid] : red[tid];
    }
}
