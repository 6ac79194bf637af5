#version 450
// The gated delta rule over n consecutive rows, one workgroup per v-head h (k-head h mod H_k), the
// invocation for value column j owning S[h][:, j]:
//   S ← exp(g)·S;  u = Sᵀk;  δ = β(v − u);  S += k δᵀ;  o = Sᵀq / √d_k.
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
    uint groups; // H_v
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
shared float ks[256];
shared float qs[256];

void main() {
    uint h = group_id();
    if (h >= p.groups) return;
    uint tid = gl_LocalInvocationID.x;
    uint dk = p.dk, dv = p.dv;
    uint a = h % p.hk;
    uint sb = h * dk * dv;
    float scale = 1.0 / sqrt(float(dk));
    for (uint t = 0; t < p.n; t++) {
        for (uint i = tid; i < dk; i += 128) {
            ks[i] = p.k.v[t * p.k_stride + a * dk + i];
            qs[i] = p.q.v[t * p.q_stride + a * dk + i];
        }
        barrier();
        float decay = exp(p.g.v[t * p.gb_stride + h]);
        float b = p.beta.v[t * p.gb_stride + h];
        for (uint j = tid; j < dv; j += 128) {
            float u = 0.0;
            for (uint i = 0; i < dk; i++) {
                float s = p.S.v[sb + i * dv + j] * decay;
                p.S.v[sb + i * dv + j] = s;
                u += s * ks[i];
            }
            float delta = b * (p.v.v[t * p.v_stride + h * dv + j] - u);
            float o = 0.0;
            for (uint i = 0; i < dk; i++) {
                float s = p.S.v[sb + i * dv + j] + ks[i] * delta;
                p.S.v[sb + i * dv + j] = s;
                o += s * qs[i];
            }
            if (p.write_out != 0) p.o.v[t * p.o_stride + h * dv + j] = o * scale;
        }
        barrier();
    }
}
