//! Times the ring all-reduce of 100 MB among 4 threads, in process or over shared memory,
//! many rounds on one mesh, so that a profiler sees the steady state:
//! `cargo run --release -p pipe-transport --example ring_profile -- shm|inproc [ROUNDS
//! [RING_BYTES]]`. Prints the median round (the slowest worker's time).

use pipe_transport::Transport;
use pipe_transport::collective::ring_all_reduce;
use pipe_transport::inproc::{InProcOptions, mesh};
use pipe_transport::shm::{ShmOptions, local_mesh};
use std::time::Instant;

fn run<T: Transport + Send>(eps: Vec<T>, rounds: u32) -> Vec<f64> {
    let n = eps.len() as u32;
    let group: Vec<u32> = (0..n).collect();
    let barrier = std::sync::Barrier::new(n as usize);
    let times: Vec<Vec<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = eps
            .into_iter()
            .map(|mut ep| {
                let (group, barrier) = (&group, &barrier);
                s.spawn(move || {
                    let mut data = vec![ep.rank() as f32; 25_000_000];
                    ring_all_reduce(&mut ep, group, 0, 0, &mut data).expect("warm-up");
                    let mut t = Vec::new();
                    for r in 1..=rounds {
                        barrier.wait();
                        let s = Instant::now();
                        ring_all_reduce(&mut ep, group, 0, r, &mut data).expect("ring");
                        t.push(s.elapsed().as_secs_f64());
                    }
                    t
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    (0..rounds as usize)
        .map(|r| times.iter().map(|t| t[r]).fold(0.0, f64::max))
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let kind = args.get(1).map_or("shm", String::as_str);
    let rounds: u32 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10);
    let mut t = match kind {
        "inproc" => run(mesh(4, &InProcOptions::default()), rounds),
        _ => {
            let mut opts = ShmOptions::new(7);
            if let Some(bytes) = args.get(3).and_then(|s| s.parse().ok()) {
                opts.ring_bytes = bytes;
            }
            run(local_mesh(4, &opts).expect("mesh"), rounds)
        }
    };
    t.sort_by(f64::total_cmp);
    println!(
        "{kind}: median {:.4} s over {rounds} rounds (min {:.4})",
        t[t.len() / 2],
        t[0]
    );
}
