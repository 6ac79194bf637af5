#version 450
// `rmsnorm` and `quant_q8` in one dispatch: y[g] = x[g] / sqrt(mean(x[g]²) + eps) ⊙ w (⊙ SiLU(z[g])
// when gated), the same operations in the same order as rmsnorm.comp (so y has its bits), and each
// 32-element block of y quantized as quant_q8.comp does (q8.glsl). A group of `gw` values (a row,
// or a head: `gpr` groups per activation row) is one workgroup; gw is a multiple of 32, so a block
// never straddles two groups. The last group of a row also zeroes its padding blocks (up to nb8).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "q8.glsl"
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4 { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32 { int v[]; };
layout(local_size_x = 256) in;
layout(push_constant, std430) uniform P {
    F32 x;      // [groups, gw]
    F32 w;      // [gw]
    F32 y;      // [groups, gw]
    F32 z;      // [groups, gw] (gated only)
    U4 q;       // [n, nb8 · 32] int8 codes
    F32 d;      // [n, nb8]
    I32 s;      // [n, nb8]
    uint groups;
    uint gw;
    float eps;
    uint gated;
    uint gpr;   // groups per activation row
    uint nb8;   // blocks per padded activation row
} p;
shared float red[256];

void main() {
    uint g = group_id();
    if (g >= p.groups) return;
    uint tid = gl_LocalInvocationID.x;
    uint base = g * p.gw;
    float ss = 0.0;
    for (uint i = tid; i < p.gw; i += 256) { float v = p.x.v[base + i]; ss += v * v; }
    red[tid] = ss;
    barrier();
    for (uint s = 128; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        barrier();
    }
    float inv = 1.0 / sqrt(red[0] / float(p.gw) + p.eps);
    uint t = g / p.gpr, gi = g % p.gpr;
    uint bpg = p.gw / 32u;              // blocks per group
    for (uint j = tid; j < bpg; j += 256) {
        vec4 xs[8];
        for (uint k = 0u; k < 8u; k++) {
            vec4 v4;
            for (uint c = 0u; c < 4u; c++) {
                uint i = 32u * j + 4u * k + c;
                float v = (p.x.v[base + i] * inv) * p.w.v[i];
                if (p.gated != 0) v *= silu(p.z.v[base + i]);
                v4[c] = v;
            }
            xs[k] = v4;
        }
        // y after every read of x (they may be one buffer): each block is this invocation's own
        for (uint k = 0u; k < 8u; k++)
            for (uint c = 0u; c < 4u; c++) p.y.v[base + 32u * j + 4u * k + c] = xs[k][c];
        uint w[8];
        float db;
        int sum;
        q8_block(xs, w, db, sum);
        uint bi = t * p.nb8 + gi * bpg + j;
        p.d.v[bi] = db;
        p.s.v[bi] = sum;
        p.q.v[2u * bi] = uvec4(w[0], w[1], w[2], w[3]);
        p.q.v[2u * bi + 1u] = uvec4(w[4], w[5], w[6], w[7]);
    }
    if (gi == p.gpr - 1u) {
        for (uint b = p.gpr * bpg + tid; b < p.nb8; b += 256) {
            uint bi = t * p.nb8 + b;
            p.d.v[bi] = 0.0;
            p.s.v[bi] = 0;
            p.q.v[2u * bi] = uvec4(0u);
            p.q.v[2u * bi + 1u] = uvec4(0u);
        }
    }
}
