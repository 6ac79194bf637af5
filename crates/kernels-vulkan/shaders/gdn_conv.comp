#version 450
// The GDN causal depthwise conv over n consecutive rows, one invocation per channel:
//   out[t, c] = SiLU(w[c, K−1]·x[t, c] + Σ_{j<K−1} w[c, j]·win[j, c]), then the window drops its oldest
//   row and x[t] becomes its newest. With write_out = 0 only the window advances (the rollback replay).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;
layout(push_constant, std430) uniform P {
    F32 x;      // [n, in_stride], pre-conv rows (channel c at offset c)
    F32 w;      // [C, K]
    F32 win;    // [K−1, C], oldest first
    F32 y;    // [n, C]
    uint groups;
    uint C;
    uint K;
    uint n;
    uint in_stride;
    uint write_out;
} p;

void main() {
    uint g = group_id();
    if (g >= p.groups) return;
    uint c = g * 64 + gl_LocalInvocationID.x;
    if (c >= p.C) return;
    uint K = p.K;
    for (uint t = 0; t < p.n; t++) {
        float xv = p.x.v[t * p.in_stride + c];
        if (p.write_out != 0) {
            float acc = p.w.v[c * K + K - 1] * xv;
            for (uint j = 0; j + 1 < K; j++) acc += p.w.v[c * K + j] * p.win.v[j * p.C + c];
            p.y.v[t * p.C + c] = silu(acc);
        }
        if (K > 1) {
            for (uint j = 0; j + 2 < K; j++) p.win.v[j * p.C + c] = p.win.v[(j + 1) * p.C + c];
            p.win.v[(K - 2) * p.C + c] = xv;
        }
    }
}
