#version 450
// After the conv: workgroup (t, j) with j < 2·H_k L2-normalizes head j of row t's q ‖ k channels
// (x / max(‖x‖, eps)) into qk; workgroup (t, 2·H_k) computes the row's gates,
// β = σ(b) and g = ssm_a · softplus(a + dt_bias) (softplus(x) = x above 20).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 128) in;
layout(push_constant, std430) uniform P {
    F32 c;       // [n, C] conv outputs: q (H_k·d_k) ‖ k (H_k·d_k) ‖ v
    F32 qk;      // [n, 2·H_k·d_k]
    F32 bb;      // [n, H_v] beta projection
    F32 aa;      // [n, H_v] alpha projection
    F32 ssm_a;   // [H_v]
    F32 dt_bias; // [H_v]
    F32 g;       // [n, H_v]
    F32 beta;    // [n, H_v]
    uint groups; // n · (2·H_k + 1)
    uint C;
    uint dk;
    uint hk;
    uint hv;
    float eps;
} p;
shared float red[128];

void main() {
    uint gid = group_id();
    if (gid >= p.groups) return;
    uint per = 2 * p.hk + 1;
    uint t = gid / per;
    uint j = gid % per;
    uint tid = gl_LocalInvocationID.x;
    if (j == 2 * p.hk) {
        for (uint h = tid; h < p.hv; h += 128) {
            uint i = t * p.hv + h;
            p.beta.v[i] = sigmoid(p.bb.v[i]);
            float a = p.aa.v[i] + p.dt_bias.v[h];
            float sp = a > 20.0 ? a : log(1.0 + exp(a));
            p.g.v[i] = p.ssm_a.v[h] * sp;
        }
        return;
    }
    uint src = t * p.C + j * p.dk;
    uint dst = t * 2 * p.hk * p.dk + j * p.dk;
    float ss = 0.0;
    for (uint i = tid; i < p.dk; i += 128) { float v = p.c.v[src + i]; ss += v * v; }
    red[tid] = ss;
    barrier();
    for (uint s = 64; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        barrier();
    }
    float inv = 1.0 / max(sqrt(red[0]), p.eps);
    for (uint i = tid; i < p.dk; i += 128) p.qk.v[dst + i] = p.c.v[src + i] * inv;
}
