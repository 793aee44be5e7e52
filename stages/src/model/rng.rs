//! Seeded randomness. Every random stream in pipe is derived from the run seed and a name, so
//! that adding a stream never shifts another and a layer's initial weights do not depend on how
//! the model is partitioned.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The generator used everywhere: ChaCha8, whose output is fixed by its specification.
pub type Rng = ChaCha8Rng;

/// Mixes `seed` with a stream name and index into an independent 64-bit seed (FNV-1a over the
/// name, then SplitMix64 finalisation).
pub fn derive_seed(seed: u64, stream: &str, index: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in stream.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    splitmix(splitmix(seed ^ h) ^ index)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A generator for stream `stream`, index `index`, of run seed `seed`.
pub fn rng_for(seed: u64, stream: &str, index: u64) -> Rng {
    Rng::seed_from_u64(derive_seed(seed, stream, index))
}
