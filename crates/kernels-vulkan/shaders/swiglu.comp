#version 450
// y = SiLU(gate) ⊙ up, elementwise (y may be gate).
#extension GL_GOOGLE_include_directive : require
#include "common.glsl"
layout(local_size_x = 256) in;
layout(push_constant, std430) uniform P {
    F32 gate;
    F32 up;
    F32 y;
    uint groups;
    uint count;
} p;

void main() {
    uint g = group_id();
    if (g >= p.groups) return;
    uint i = g * 256 + gl_LocalInvocationID.x;
    if (i < p.count) p.y.v[i] = silu(p.gate.v[i]) * p.up.v[i];
}
