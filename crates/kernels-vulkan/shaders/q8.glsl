// The CPU engine's int8 activation quantization of one 32-element block
// (`bonsai_kernels_cpu::ops::quantize_acts`): d = amax / 127 (f32), q = round_half_away(x · (1 / d))
// clamped to ±127, d = 0 and q = 0 for an all-zero block. The divisions are rounded as IEEE
// division rounds (one refinement step after the reciprocal; needs a fused fma).

// a / b rounded to nearest even, as IEEE division (b finite, nonzero): the reciprocal refined once,
// then the quotient corrected by its exact residual.
float div_rn(float a, float b) {
    precise float r = 1.0 / b;
    precise float er = fma(-b, r, 1.0);
    r = fma(er, r, r);
    precise float q = a * r;
    precise float e = fma(-q, b, a);
    precise float res = fma(e, r, q);
    return res;
}

uint pack4(ivec4 c) {
    return (uint(c.x) & 0xFFu) | ((uint(c.y) & 0xFFu) << 8) | ((uint(c.z) & 0xFFu) << 16) | (uint(c.w) << 24);
}

// One value's code given its block's 1 / d.
int q8_code(float x, float id) {
    precise float v = x * id;
    float tr = trunc(v);
    // round half away from zero: v − trunc(v) is exact
    float r = abs(v - tr) >= 0.5 ? tr + sign(v) : tr;
    return int(clamp(r, -127.0, 127.0));
}

// xs: the block's 32 values → w: 8 words of 4 codes (element order), d, Σ codes.
void q8_block(vec4 xs[8], out uint w[8], out float d, out int sum) {
    float amax = 0.0;
    for (uint k = 0u; k < 8u; k++) {
        vec4 a = abs(xs[k]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    d = amax == 0.0 ? 0.0 : div_rn(amax, 127.0);
    float id = d == 0.0 ? 0.0 : div_rn(1.0, d);
    sum = 0;
    for (uint k = 0u; k < 8u; k++) {
        precise vec4 v = xs[k] * id;
        vec4 tr = trunc(v);
        // round half away from zero: v − trunc(v) is exact
        vec4 r = tr + mix(vec4(0.0), sign(v), greaterThanEqual(abs(v - tr), vec4(0.5)));
        ivec4 c = ivec4(clamp(r, -127.0, 127.0));
        sum += (c.x + c.y) + (c.z + c.w);
        w[k] = pack4(c);
    }
}
