#version 450
// Activation rows f32 → int8 codes in 32-element blocks, the CPU engine's scheme exactly
// (`bonsai_kernels_cpu::ops::quantize_acts`): d = amax / 127 (f32), q = round_half_away(x · (1 / d))
// clamped to ±127, d = 0 and q = 0 for an all-zero block, and Σq per block. Rows are padded with
// zero blocks to a multiple of 8 blocks (256 elements), as the CPU pads them. One invocation per
// block. The divisions are rounded as IEEE division rounds (one refinement step after the
// reciprocal), so codes and scales equal the CPU's bit for bit.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "q8.glsl"
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
    for (uint k = 0u; k < 8u; k++) xs[k] = p.x.v[xb + k];
    uint w[8];
    float db;
    int sum;
    q8_block(xs, w, db, sum);
    p.d.v[i] = db;
    p.s.v[i] = sum;
    p.q.v[2u * i] = uvec4(w[0], w[1], w[2], w[3]);
    p.q.v[2u * i + 1u] = uvec4(w[4], w[5], w[6], w[7]);
}
