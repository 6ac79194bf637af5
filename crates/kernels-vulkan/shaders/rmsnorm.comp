#version 450
// y[g] = x[g] / sqrt(mean(x[g]²) + eps) ⊙ w, for each group g of `gw` consecutive values (a row, or a
// head); with `gated`, also ⊙ SiLU(z[g]) (the GDN output norm). x and y may be the same buffer.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant, std430) uniform P {
    F32 x;      // [groups, gw]
    F32 w;      // [gw]
    F32 y;      // [groups, gw]
    F32 z;      // [groups, gw] (gated only)
    uint groups;
    uint gw;
    float eps;
    uint gated;
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
    for (uint i = tid; i < p.gw; i += 256) {
        float v = (p.x.v[base + i] * inv) * p.w.v[i];
        if (p.gated != 0) v *= silu(p.z.v[base + i]);
        p.y.v[base + i] = v;
    }
}
