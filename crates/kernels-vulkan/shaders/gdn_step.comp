#version 450
// The gated delta rule over n consecutive rows. A workgroup takes 32 value columns j of one v-head h
// (k-head h mod H_k); its 128 invocations are 4 parts × 32 columns, part q holding
// S[h][q·d_k/4 .. (q+1)·d_k/4, j] in registers for all n rows (d_k ≤ 128, a multiple of 4):
//   S ← exp(g)·S;  u = Sᵀk;  δ = β(v − u);  S += k δᵀ;  o = Sᵀq / √d_k,
// each of u and o summed per part in increasing i, then the 4 parts in a fixed order.
// Rows are read at their own strides, so the same shader runs the forward (q, k from gdn_prep, v from
// the conv output) and the rollback replay (k, v, g, β from the verify record, write_out = 0).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 128) in;
layout(push_constant, std430) uniform P {
    F32 S;      // [H_v, d_k, d_v]
    F32 q;      // row t, k-head a at t·q_stride + a·d_k
    F32 k;      // row t, k-head a at t·k_stride + a·d_k
    F32 v;      // row t, v-head h at t·v_stride + h·d_v
    F32 g;      // row t at t·gb_stride + h
    F32 beta;   // row t at t·gb_stride + h
    F32 o;      // [n, H_v·d_v] at t·o_stride + h·d_v
    uint groups; // H_v · ceil(d_v / 32)
    uint dk;
    uint dv;
    uint hk;
    uint n;
    uint q_stride;
    uint k_stride;
    uint v_stride;
    uint gb_stride;
    uint o_stride;
    uint write_out;
} p;
#define MAXQ 32u
shared float ks[4u * MAXQ];
shared float qs[4u * MAXQ];
shared float red[4][32];

void main() {
    uint gid = group_id();
    if (gid >= p.groups) return;
    uint dk = p.dk, dv = p.dv;
    uint ncc = (dv + 31u) / 32u;
    uint h = gid / ncc;
    uint tid = gl_LocalInvocationID.x;
    uint jl = tid & 31u, part = tid >> 5;
    uint j = (gid % ncc) * 32u + jl;
    bool live = j < dv;
    uint a = h % p.hk;
    uint nq = dk / 4u, i0 = part * nq;
    uint sb = h * dk * dv;
    float scale = 1.0 / sqrt(float(dk));
    float S[MAXQ];
    for (uint ii = 0; ii < MAXQ; ii++)
        S[ii] = (ii < nq && live) ? p.S.v[sb + (i0 + ii) * dv + j] : 0.0;
    for (uint t = 0; t < p.n; t++) {
        if (tid < dk) {
            ks[tid] = p.k.v[t * p.k_stride + a * dk + tid];
            qs[tid] = p.q.v[t * p.q_stride + a * dk + tid];
        }
        barrier();
        float decay = exp(p.g.v[t * p.gb_stride + h]);
        float b = p.beta.v[t * p.gb_stride + h];
        float u = 0.0;
        for (uint ii = 0; ii < MAXQ; ii++) {
            if (ii < nq) {
                S[ii] *= decay;
                u += S[ii] * ks[i0 + ii];
            }
        }
        red[part][jl] = u;
        barrier();
        u = (red[0][jl] + red[1][jl]) + (red[2][jl] + red[3][jl]);
        float delta = live ? b * (p.v.v[t * p.v_stride + h * dv + j] - u) : 0.0;
        float o = 0.0;
        for (uint ii = 0; ii < MAXQ; ii++) {
            if (ii < nq) {
                S[ii] += ks[i0 + ii] * delta;
                o += S[ii] * qs[i0 + ii];
            }
        }
        barrier();
        red[part][jl] = o;
        barrier();
        if (part == 0u && live && p.write_out != 0u)
            p.o.v[t * p.o_stride + h * dv + j] = ((red[0][jl] + red[1][jl]) + (red[2][jl] + red[3][jl])) * scale;
        barrier();
    }
    for (uint ii = 0; ii < MAXQ; ii++)
        if (ii < nq && live) p.S.v[sb + (i0 + ii) * dv + j] = S[ii];
}
