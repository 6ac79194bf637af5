// Shared declarations of every bonsai compute shader.
//
// Buffers are passed by device address in the push constants (Vulkan 1.2 bufferDeviceAddress), so no
// shader has a descriptor set: the host fills one push-constant block per dispatch, addresses first
// (8-byte aligned), then 32-bit scalars. A dispatch covers `groups` workgroups, laid out by the host
// as (x ≤ 65535, y); `group_id()` is the linear index and every shader returns when it is past
// `groups`. No shader assumes a subgroup size: reductions go through shared memory in a fixed order,
// so a row's result never depends on how many rows the dispatch has (batch invariance).
#extension GL_EXT_buffer_reference : require

layout(buffer_reference, std430, buffer_reference_align = 4) buffer F32 { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer U32 { uint v[]; };

uint group_id() { return gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x; }

float sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }
float silu(float x) { return x * sigmoid(x); }
