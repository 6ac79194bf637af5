#version 450
// Attention inputs of n rows at positions pos0 .. pos0 + n − 1, one workgroup per (row t, slot):
//   slot < H           query head: RMSNorm (q_norm), partial NEOX RoPE → q [n, H, hd] f32
//   slot < H + H_kv    key head:   RMSNorm (k_norm), partial NEOX RoPE → K cache row pos0 + t (f16)
//   otherwise          value head: as is                                → V cache row pos0 + t (f16)
// RoPE reads a host table of (cos, sin) per row and rotated pair (computed in f64 there).
// With q8 = 1 the cache rows are ggml q8_0 blocks instead of f16: per 32 values d = f16(amax / 127)
// (kept as f32 at word `sc_off` + block), codes round(x · 127 / amax) (half away from zero, ±127),
// four codes per word — the CPU backend's rounding.
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
    U32 kc;     // [n_ctx, H_kv·hd] f16, two per word (q8: i8 codes, four per word, then scales)
    U32 vc;     // the same for V
    uint groups; // n · (H + 2·H_kv)
    uint nh;
    uint nkv;
    uint hd;
    uint n_rot;
    uint pos0;
    float eps;
    uint q8;
    uint sc_off; // q8: word offset of the scales [n_ctx, H_kv·hd / 32] f32
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
    } else if (p.q8 != 0) {
        uint kh = is_v ? slot - p.nh - p.nkv : slot - p.nh;
        uint e0 = (p.pos0 + t) * kvw + kh * hd; // first element of this head's row
        for (uint b = tid; b < hd / 32; b += 64) {
            float amax = 0.0;
            for (uint j = 0; j < 32; j++) amax = max(amax, abs(hv[32 * b + j]));
            float d = unpackHalf2x16(packHalf2x16(vec2(amax / 127.0, 0.0))).x;
            float inv = amax > 0.0 ? 127.0 / amax : 0.0;
            for (uint w = 0; w < 8; w++) {
                uint word = 0u;
                for (uint k = 0; k < 4; k++) {
                    float v = hv[32 * b + 4 * w + k] * inv;
                    float q = clamp(sign(v) * floor(abs(v) + 0.5), -127.0, 127.0);
                    word |= (uint(int(q)) & 0xffu) << (8u * k);
                }
                uint wi = (e0 + 32 * b) / 4 + w;
                if (is_v) p.vc.v[wi] = word; else p.kc.v[wi] = word;
            }
            uint si = p.sc_off + e0 / 32 + b;
            if (is_v) p.vc.v[si] = floatBitsToUint(d); else p.kc.v[si] = floatBitsToUint(d);
        }
    } else {
        uint kh = is_v ? slot - p.nh - p.nkv : slot - p.nh;
        uint w0 = ((p.pos0 + t) * kvw + kh * hd) / 2;
        for (uint i = tid; i < hd / 2; i += 64) {
            uint wv = packHalf2x16(vec2(hv[2 * i], hv[2 * i + 1]));
            if (is_v) p.vc.v[w0 + i] = wv; else p.kc.v[w0 + i] = wv;
        }
    }
}
