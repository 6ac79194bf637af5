#version 450
// Attention inputs of n rows at positions pos0 .. pos0 + n − 1, one workgroup per (row t, slot):
//   slot < H           query head: RMSNorm (q_norm), partial NEOX RoPE → q [n, H, hd] f32
//   slot < H + H_kv    key head:   RMSNorm (k_norm), partial NEOX RoPE → K cache row pos0 + t (f16)
//   otherwise          value head: as is                                → V cache row pos0 + t (f16)
// RoPE reads a host table of (cos, sin) per row and rotated pair (computed in f64 there).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;
layout(push_constant, std430) uniform P {
    F32 qf;     // [n, H, 2, hd] (query ‖ gate per head)
    F32 kf;     // [n, H_kv·hd]
    F32 vf;     // [n, H_kv·hd]
    F32 qn;     // [hd]
    F32 kn;     // [hd]
    F32 rope;   // [n, n_rot/2, 2]
    F32 q;      // [n, H, hd]
    U32 kc;     // [n_ctx, H_kv·hd] f16, two per word
    U32 vc;     // [n_ctx, H_kv·hd] f16
    uint groups; // n · (H + 2·H_kv)
    uint nh;
    uint nkv;
    uint hd;
    uint n_rot;
    uint pos0;
    float eps;
} p;
shared float hv[512];
shared float red[64];

void main() {
    uint gid = group_id();
    if (gid >= p.groups) return;
    uint per = p.nh + 2 * p.nkv;
    uint t = gid / per;
    uint slot = gid % per;
    uint tid = gl_LocalInvocationID.x;
    uint hd = p.hd;
    uint kvw = p.nkv * hd;
    bool is_q = slot < p.nh;
    bool is_v = slot >= p.nh + p.nkv;
    uint src;
    if (is_q) src = (t * p.nh + slot) * 2 * hd;
    else if (!is_v) src = t * kvw + (slot - p.nh) * hd;
    else src = t * kvw + (slot - p.nh - p.nkv) * hd;
    for (uint i = tid; i < hd; i += 64) hv[i] = is_q ? p.qf.v[src + i] : (is_v ? p.vf.v[src + i] : p.kf.v[src + i]);
    barrier();
    if (!is_v) {
        float ss = 0.0;
        for (uint i = tid; i < hd; i += 64) ss += hv[i] * hv[i];
        red[tid] = ss;
        barrier();
        for (uint s = 32; s > 0; s >>= 1) {
            if (tid < s) red[tid] += red[tid + s];
            barrier();
        }
        float inv = 1.0 / sqrt(red[0] / float(hd) + p.eps);
        barrier();
        for (uint i = tid; i < hd; i += 64) hv[i] = (hv[i] * inv) * (is_q ? p.qn.v[i] : p.kn.v[i]);
        barrier();
        uint half_ = p.n_rot / 2;
        for (uint d = tid; d < half_; d += 64) {
            float c = p.rope.v[(t * half_ + d) * 2];
            float s = p.rope.v[(t * half_ + d) * 2 + 1];
            float a = hv[d], b = hv[d + half_];
            hv[d] = a * c - b * s;
            hv[d + half_] = a * s + b * c;
        }
        barrier();
    }
    if (is_q) {
        uint dst = (t * p.nh + slot) * hd;
        for (uint i = tid; i < hd; i += 64) p.q.v[dst + i] = hv[i];
    } else {
        uint kh = is_v ? slot - p.nh - p.nkv : slot - p.nh;
        uint w0 = ((p.pos0 + t) * kvw + kh * hd) / 2;
        for (uint i = tid; i < hd / 2; i += 64) {
            uint wv = packHalf2x16(vec2(hv[2 * i], hv[2 * i + 1]));
            if (is_v) p.vc.v[w0 + i] = wv; else p.kc.v[w0 + i] = wv;
        }
    }
}
