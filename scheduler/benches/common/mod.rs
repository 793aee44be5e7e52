//! The seeded synthetic profile shared by the partition benchmark and the `plan_speed`
//! example.

use pipe_scheduler::{LayerProfile, Profile};

/// A seeded 1,000-layer profile (xorshift noise; no dependencies).
pub fn profile(layers: usize) -> Profile {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        0.7 + 0.6 * (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let kinds = [
        (4e-3, 8e6, 4e6),
        (8e-3, 32e6, 4e6),
        (2e-4, 0.0, 4e6),
        (1e-3, 1e5, 4e6),
    ];
    Profile::chain(
        (0..layers)
            .map(|i| {
                let (t, p, a) = kinds[i % kinds.len()];
                LayerProfile {
                    name: format!("layer{i}"),
                    forward: t * noise(),
                    backward_input: t * noise(),
                    backward_weight: t * noise(),
                    backward: None,
                    update: p / 1e11,
                    activation_bytes: a * noise(),
                    param_bytes: p,
                    stash_bytes: None,
                    recompute_stash_bytes: None,
                }
            })
            .collect(),
    )
}
