#version 450
// y[t, o] (+)= Σ_i W[o, i] · x[t, i]. A workgroup of 128 invocations (4 slices of 32 lanes) takes
// ROWS consecutive outputs o of one activation row t. The input is walked in chunks of 128
// elements, 8 chunks to a group; slice s takes groups s, s + 4, … and lane l elements 4l .. 4l + 3
// of each chunk: one 16-byte load of x (512 contiguous bytes per slice) serves the ROWS outputs,
// and one coalesced load per output and group brings the lane's codes of 8 chunks (`retile.rs`),
// the next group's codes loaded while this one is used. Each invocation keeps one f32 partial per
// output (its groups and chunks in increasing order), then the 128 partials meet in a fixed-order
// tree in shared memory. The code and the order for (o, t) do not depend on the number of rows (a
// verify row equals the decode row bit for bit).
//   QT 0  Q1_0:       block 128; codes [n_out, groups, 32] u32, 4 bits per chunk → w = bit ? +d : −d
//   QT 1  Q2_0 g128:  block 128; codes [n_out, groups, 32] uvec2, 8 bits per chunk → w = (c − 1)·d
//   QT 2  Q2_0 g64:   block 64;  the same codes, two scales per chunk
//   QT 3  f32:        codes hold the f32 row-major matrix [n_out, n_in], no scales
// scales [n_out, n_in / block] f32. n_in is a multiple of 4; a chunk past n_in is masked per lane.
// x rows must be 16-byte aligned (the host checks).
#extension GL_GOOGLE_include_directive : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
layout(buffer_reference, std430, buffer_reference_align = 16) buffer V4 { vec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 16) buffer U4 { uvec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer U2 { uvec2 v[]; };
layout(local_size_x = 128) in;
layout(push_constant, std430) uniform P {
#if QT == 3
    U4 codes;
#elif QT == 0
    U32 codes;
#else
    U2 codes;
#endif
    F32 scales;
    V4 x;       // [n, n_in]
    F32 y;      // [n, n_out]
    uint groups; // ceil(n_out / ROWS) · n
    uint n_in;
    uint n_out;
    uint acc;   // 1: y += result
} p;

#define ROWS 4u
shared float red[ROWS][128];

#if QT == 0
#define CODE uint
#elif QT == 1 || QT == 2
#define CODE uvec2
#endif

// x with its sign flipped where bit `bit` of b is 0: x·(2·bit − 1), exact.
float pm(float x, uint b, uint bit) {
    return uintBitsToFloat(floatBitsToUint(x) ^ (((~b >> bit) & 1u) << 31));
}

// 2-bit code c at bit `sh` of b → c − 1 as f32, exact: (2^23 + c) − (2^23 + 1).
float cm1(uint b, uint sh) {
    return uintBitsToFloat(0x4B000000u | ((b >> sh) & 3u)) - 8388609.0;
}

void main() {
    uint gid = group_id();
    if (gid >= p.groups) return;
    uint tid = gl_LocalInvocationID.x;
    uint lane = tid & 31u, slice = tid >> 5;
    uint per_row = (p.n_out + ROWS - 1u) / ROWS;
    uint t = gid / per_row;
    uint o0 = (gid % per_row) * ROWS;
    uint n4 = p.n_in / 4u;          // x in vec4
    uint nch = (p.n_in + 127u) / 128u;
    uint xb = t * n4;
    uint orow[ROWS];                 // rows past n_out compute row n_out − 1 and are not stored
    [[unroll]] for (uint r = 0; r < ROWS; r++) orow[r] = min(o0 + r, p.n_out - 1u);
    float acc[ROWS];
    [[unroll]] for (uint r = 0; r < ROWS; r++) acc[r] = 0.0;
#if QT == 3
    for (uint c = slice; c < nch; c += 4u) {
        uint xi = c * 32u + lane;
        if (xi < n4) {
            vec4 xx = p.x.v[xb + xi];
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
                vec4 w = uintBitsToFloat(p.codes.v[orow[r] * n4 + xi]);
                acc[r] += (w.x * xx.x + w.y * xx.y) + (w.z * xx.z + w.w * xx.w);
            }
        }
    }
#else
    uint ng = (nch + 7u) / 8u;
#if QT == 2
    uint nblk = p.n_in / 64u;
#else
    uint nblk = p.n_in / 128u;
#endif
    CODE nxt[ROWS];
    if (slice < ng)
        [[unroll]] for (uint r = 0; r < ROWS; r++) nxt[r] = p.codes.v[(orow[r] * ng + slice) * 32u + lane];
    for (uint g = slice; g < ng; g += 4u) {
        CODE cw[ROWS];
        [[unroll]] for (uint r = 0; r < ROWS; r++) cw[r] = nxt[r];
        if (g + 4u < ng)
            [[unroll]] for (uint r = 0; r < ROWS; r++) nxt[r] = p.codes.v[(orow[r] * ng + g + 4u) * 32u + lane];
        [[unroll]] for (uint k = 0; k < 8u; k++) {
            uint c = g * 8u + k;
            uint xi = c * 32u + lane;
            if (c >= nch || xi >= n4) break;
            vec4 xx = p.x.v[xb + xi];
            [[unroll]] for (uint r = 0; r < ROWS; r++) {
#if QT == 0
                uint sh = 4u * k;
                uint b = cw[r];
                float s = (pm(xx.x, b, sh) + pm(xx.y, b, sh + 1u)) + (pm(xx.z, b, sh + 2u) + pm(xx.w, b, sh + 3u));
                acc[r] = fma(p.scales.v[orow[r] * nblk + c], s, acc[r]);
#else
                uint b = k < 4u ? cw[r].x : cw[r].y;
                uint sh = 8u * (k & 3u);
                float s = (cm1(b, sh) * xx.x + cm1(b, sh + 2u) * xx.y) + (cm1(b, sh + 4u) * xx.z + cm1(b, sh + 6u) * xx.w);
#if QT == 1
                acc[r] = fma(p.scales.v[orow[r] * nblk + c], s, acc[r]);
#else
                acc[r] = fma(p.scales.v[orow[r] * nblk + 2u * c + (lane >> 4)], s, acc[r]);
#endif
#endif
            }
        }
    }
#endif
    [[unroll]] for (uint r = 0; r < ROWS; r++) red[r][tid] = acc[r];
    barrier();
    [[unroll]] for (uint s = 64u; s > 0u; s >>= 1) {
        if (tid < s)
            [[unroll]] for (uint r = 0; r < ROWS; r++) red[r][tid] += red[r][tid + s];
        barrier();
    }
    if (tid < ROWS && o0 + tid < p.n_out) {
        uint yi = t * p.n_out + o0 + tid;
        float v = red[tid][0];
        p.y.v[yi] = p.acc != 0u ? p.y.v[yi] + v : v;
    }
}
