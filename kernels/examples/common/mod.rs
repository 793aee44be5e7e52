//! What the kernel examples share: the timing rule.

use std::time::Instant;

/// Median seconds of `f` over 31 calls after 5 warm-up calls.
pub fn median_seconds(f: &mut dyn FnMut()) -> f64 {
    for _ in 0..5 {
        f();
    }
    let mut times: Vec<f64> = (0..31)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
