//! Fragment helpers shared by the host replays of tensor-core kernels (tests only).

/// Adds the 16 × 8 product `prod(row, col)` to per-lane `mma` C fragments (PTX layout for every
/// m16n8kK shape, g = lane / 4, q = lane % 4): c0 (g, 2q), c1 (g, 2q+1), c2 (g+8, 2q),
/// c3 (g+8, 2q+1).
pub(crate) fn mma_c_add(c: &mut [[f64; 4]; 32], prod: impl Fn(usize, usize) -> f64) {
    for (lane, cl) in c.iter_mut().enumerate() {
        let (g, q) = (lane / 4, lane % 4);
        cl[0] += prod(g, 2 * q);
        cl[1] += prod(g, 2 * q + 1);
        cl[2] += prod(g + 8, 2 * q);
        cl[3] += prod(g + 8, 2 * q + 1);
    }
}

/// A small deterministic generator (splitmix64) for the replays' random inputs.
pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
