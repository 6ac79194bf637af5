#version 450
// `rmsnorm` and `quant_q8` in one dispatch: y[g] = x[g] / sqrt(mean(x[g]²) + eps) ⊙ w (⊙ SiLU(z[g])
// when gated), the same operations in the same order as rmsnorm.comp (so y has its bits), and each
// 32-element block of y quantized as quant_q8.comp does (q8.glsl), with the same bits. A group of
// `gw` values (a row, or a head: `gpr` groups per activation row; gw a multiple of 32) is split into
// parts of 8 blocks, one workgroup each: every workgroup of a group computes the group's sum of
// squares in rmsnorm's order (the same value in each), then one invocation per element of its part.
// The last part of a row's last group also zeroes the row's padding blocks (up to nb8).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
#include "q8.glsl"
layout(buffer_reference, std430, buffer_reference_align = 4) buffer I32 { int v[]; };
layout(local_size_x = 256) in;
layout(push_constant, std430) uniform P {
    F32 x;      // [groups, gw]
    F32 w;      // [gw]
    F32 y;      // [groups, gw]
    F32 z;      // [groups, gw] (gated only)
    U32 q;      // [n, nb8 · 8] words of 4 int8 codes
    F32 d;      // [n, nb8]
    I32 s;      // [n, nb8]
    uint groups;  // groups · parts workgroups (parts = ceil(gw / 256))
    uint gw;
    float eps;
    uint gated;
    uint gpr;   // groups per activation row
    uint nb8;   // blocks per padded activation row
} p;
shared float red[256];
shared float bmax[256];
shared float bd[8];
shared float bid[8];
shared int code[256];

void main() {
    uint parts = (p.gw + 255u) / 256u;
    uint gid = group_id();
    if (gid >= p.groups) return;
    uint g = gid / parts, part = gid % parts;
    uint tid = gl_LocalInvocationID.x;
    uint base = g * p.gw;
    // the group's sum of squares, exactly as rmsnorm.comp computes it
    float ss = 0.0;
    for (uint i = tid; i < p.gw; i += 256) { float v = p.x.v[base + i]; ss += v * v; }
    red[tid] = ss;
    barrier();
    for (uint s = 128; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        barrier();
    }
    float inv = 1.0 / sqrt(red[0] / float(p.gw) + p.eps);
    // this part's elements: one each
    uint i = part * 256u + tid;
    bool in_group = i < p.gw;
    float v = 0.0;
    if (in_group) {
        v = (p.x.v[base + i] * inv) * p.w.v[i];
        if (p.gated != 0) v *= silu(p.z.v[base + i]);
    }
    // every read of x is done (x and y may be one buffer) before y is written
    barrier();
    if (in_group) p.y.v[base + i] = v;
    // per 32-element block: amax (max is exact in any order), then d and 1/d by one invocation
    bmax[tid] = abs(v);
    barrier();
    for (uint s = 16u; s > 0u; s >>= 1) {
        if ((tid & 31u) < s) bmax[tid] = max(bmax[tid], bmax[tid + s]);
        barrier();
    }
    uint blk = tid >> 5;
    if ((tid & 31u) == 0u) {
        float amax = bmax[tid];
        float db = amax == 0.0 ? 0.0 : div_rn(amax, 127.0);
        bd[blk] = db;
        bid[blk] = db == 0.0 ? 0.0 : div_rn(1.0, db);
    }
    barrier();
    code[tid] = q8_code(v, bid[blk]);
    barrier();
    uint t = g / p.gpr, gi = g % p.gpr;
    uint bpg = p.gw / 32u;
    uint b0 = t * p.nb8 + gi * bpg + part * 8u;   // this part's first block in the q8 row
    uint nblk = min(8u, bpg - part * 8u);
    if (tid < nblk * 8u) {
        // word k of block tid / 8: codes 4k .. 4k + 3 of it
        uint bb = tid >> 3, k = tid & 7u, c0 = bb * 32u + 4u * k;
        p.q.v[(b0 + bb) * 8u + k] = pack4(ivec4(code[c0], code[c0 + 1u], code[c0 + 2u], code[c0 + 3u]));
    }
    if (tid < nblk) {
        int sum = 0;
        for (uint j = 0u; j < 32u; j += 4u)
            sum += (code[tid * 32u + j] + code[tid * 32u + j + 1u]) + (code[tid * 32u + j + 2u] + code[tid * 32u + j + 3u]);
        p.d.v[b0 + tid] = bd[tid];
        p.s.v[b0 + tid] = sum;
    }
    if (gi == p.gpr - 1u && part == parts - 1u) {
        for (uint b = p.gpr * bpg + tid; b < p.nb8; b += 256) {
            uint bi = t * p.nb8 + b;
            p.d.v[bi] = 0.0;
            p.s.v[bi] = 0;
            for (uint k = 0u; k < 8u; k++) p.q.v[bi * 8u + k] = 0u;
        }
    }
}
