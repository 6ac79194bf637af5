#version 450
// Activation rows f32 → int8 codes in 32-element blocks, the CPU engine's scheme exactly
// (`bonsai_kernels_cpu::ops::quantize_acts`): d = amax / 127 (f32), q = round_half_away(x · (1 / d))
// clamped to ±127, d = 0 and q = 0 for an all-zero block, and Σq per block. Rows are padded with
// zero blocks to a multiple of 8 blocks (256 elements), as the CPU pads them. One invocation per
// block. The divisions are rounded as IEEE division rounds (one refinement step after the
// reciprocal), so codes and scales equal the CPU's bit for bit.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4 { vec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4 { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32 { int v[]; };
layout(local_size_x = 128) in;
layout(push_constant, std430) uniform P {
    V4 x;       // [n, width] f32 (16-byte aligned rows)
    U4 q;       // [n, nb8 · 32] int8 codes, 4 per word, element order
    F32 d;      // [n, nb8] block scales
    I32 s;      // [n, nb8] Σq per block
    uint groups;  // ceil(n · nb8 / 128)
    uint n;
    uint width;   // a multiple of 32
    uint nb8;     // blocks per padded row: ceil(width / 256) · 8
} p;

// a / b rounded to nearest even, as IEEE division (b finite, nonzero): the reciprocal refined once,
// then the quotient corrected by its exact residual.
float div_rn(float a, float b) {
    precise float r = 1.0 / b;
    precise float er = fma(-b, r, 1.0);
    r = fma(er, r, r);
    precise float q = a * r;
    precise float e = fma(-q, b, a);
    precise float res = fma(e, r, q);
    return res;
}

uint pack4(ivec4 c) {
    return (uint(c.x) & 0xFFu) | ((uint(c.y) & 0xFFu) << 8) | ((uint(c.z) & 0xFFu) << 16) | (uint(c.w) << 24);
}

void main() {
    uint i = group_id() * 128u + gl_LocalInvocationID.x;
    if (i >= p.n * p.nb8) return;
    uint t = i / p.nb8, b = i % p.nb8;
    uint nb = p.width / 32u;
    if (b >= nb) {
        p.d.v[i] = 0.0;
        p.s.v[i] = 0;
        p.q.v[2u * i] = uvec4(0u);
        p.q.v[2u * i + 1u] = uvec4(0u);
        return;
    }
    uint xb = (t * p.width + 32u * b) / 4u;
    vec4 xs[8];
    float amax = 0.0;
    for (uint k = 0u; k < 8u; k++) {
        xs[k] = p.x.v[xb + k];
        vec4 a = abs(xs[k]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    float db = amax == 0.0 ? 0.0 : div_rn(amax, 127.0);
    float id = db == 0.0 ? 0.0 : div_rn(1.0, db);
    int sum = 0;
    uint w[8];
    for (uint k = 0u; k < 8u; k++) {
        precise vec4 v = xs[k] * id;
        vec4 tr = trunc(v);
        // round half away from zero: v − trunc(v) is exact
        vec4 r = tr + mix(vec4(0.0), sign(v), greaterThanEqual(abs(v - tr), vec4(0.5)));
        ivec4 c = ivec4(clamp(r, -127.0, 127.0));
        sum += (c.x + c.y) + (c.z + c.w);
        w[k] = pack4(c);
    }
    p.d.v[i] = db;
    p.s.v[i] = sum;
    p.q.v[2u * i] = uvec4(w[0], w[1], w[2], w[3]);
    p.q.v[2u * i + 1u] = uvec4(w[4], w[5], w[6], w[7]);
}
