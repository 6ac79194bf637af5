#version 450
// Causal attention for n rows at positions pos0 .. , one workgroup per (row t, query head h) over the
// f16 cache rows 0 ..= pos0 + t of kv head h / (H / H_kv): tiles of 64 positions (one score per
// invocation), an online softmax whose running max and sum every invocation keeps identically, each
// invocation owning output dims tid, tid + 64, ...; then ⊙ σ(gate). Independent of n.
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 64) in;
layout(push_constant, std430) uniform P {
    F32 q;      // [n, H, hd]
    F32 qf;     // [n, H, 2, hd], the gate half of each head is read
    U32 kc;     // [n_ctx, H_kv·hd] f16 (q8: i8 codes four per word, then f32 scales per 32)
    U32 vc;     // the same for V
    F32 y;    // [n, H, hd]
    uint groups; // n · H
    uint nh;
    uint nkv;
    uint hd;
    uint pos0;
    float scale;
    uint q8;
    uint sc_off; // q8: word offset of the scales
} p;
shared float qv[512];
shared float pw[64];

float kv_at(U32 buf, uint idx) {
    if (p.q8 != 0) {
        int c = int(buf.v[idx >> 2] << (24u - 8u * (idx & 3u))) >> 24;
        return float(c) * uintBitsToFloat(buf.v[p.sc_off + (idx >> 5)]);
    }
    vec2 two = unpackHalf2x16(buf.v[idx >> 1]);
    return (idx & 1u) != 0u ? two.y : two.x;
}

void main() {
    uint gid = group_id();
    if (gid >= p.groups) return;
    uint t = gid / p.nh;
    uint h = gid % p.nh;
    uint tid = gl_LocalInvocationID.x;
    uint hd = p.hd;
    uint kvw = p.nkv * hd;
    uint kh = h / (p.nh / p.nkv);
    uint len = p.pos0 + t + 1;
    uint qb = (t * p.nh + h) * hd;
    for (uint i = tid; i < hd; i += 64) qv[i] = p.q.v[qb + i];
    barrier();
    float acc[8];
    for (uint m = 0; m < 8; m++) acc[m] = 0.0;
    float mx = -1.0 / 0.0;
    float l = 0.0;
    for (uint start = 0; start < len; start += 64) {
        uint j = start + tid;
        float sc = -1.0 / 0.0;
        if (j < len) {
            uint kb = j * kvw + kh * hd;
            float d = 0.0;
            for (uint i = 0; i < hd; i++) d += qv[i] * kv_at(p.kc, kb + i);
            sc = d * p.scale;
        }
        pw[tid] = sc;
        barrier();
        float tmax = mx;
        for (uint jj = 0; jj < 64; jj++) tmax = max(tmax, pw[jj]);
        barrier();
        pw[tid] = j < len ? exp(sc - tmax) : 0.0;
        barrier();
        float corr = exp(mx - tmax);
        float tsum = 0.0;
        for (uint jj = 0; jj < 64; jj++) tsum += pw[jj];
        l = l * corr + tsum;
        uint tl = min(64u, len - start);
        for (uint m = 0; m < 8; m++) {
            uint d = tid + 64 * m;
            if (d >= hd) break;
            float a = acc[m] * corr;
            for (uint jj = 0; jj < tl; jj++) a += pw[jj] * kv_at(p.vc, (start + jj) * kvw + kh * hd + d);
            acc[m] = a;
        }
        mx = tmax;
        barrier();
    }
    uint gb = (t * p.nh + h) * 2 * hd + hd;
    for (uint m = 0; m < 8; m++) {
        uint d = tid + 64 * m;
        if (d >= hd) break;
        p.y.v[qb + d] = acc[m] / l * sigmoid(p.qf.v[gb + d]);
    }
}
