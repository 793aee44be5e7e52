//! Scratch: dX = dY W^T layouts through gemm, 256x1024x1024.
use std::time::Instant;

fn main() {
    let (m, k, n) = (256usize, 1024usize, 1024usize); // dX m x n, dY m x k, W n x k (in x out)
    let dy: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 * 0.01).collect();
    let mut wt = vec![0.0f32; n * k];
    let mut dx = vec![0.0f32; m * n];
    let mut scratch = vec![0.0f32; m * n];
    let threads: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let flops = 2.0 * (m * n * k) as f64;
    let time = |name: &str, f: &mut dyn FnMut()| {
        for _ in 0..5 {
            f();
        }
        let mut v = Vec::new();
        for _ in 0..31 {
            let t = Instant::now();
            f();
            v.push(t.elapsed().as_secs_f64());
        }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!(
            "{name:40} {:7.3} ms {:6.1} GFLOP/s",
            v[15] * 1e3,
            flops / v[15] / 1e9
        );
    };
    pool.install(|| {
        time("a: dY W^T (rhs strided)", &mut || unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dx.as_mut_ptr(),
                1,
                n as isize,
                false,
                dy.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                k as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        });
        time("b: W dY^T into C col-major", &mut || unsafe {
            gemm::gemm(
                n,
                m,
                k,
                dx.as_mut_ptr(),
                n as isize,
                1,
                false,
                w.as_ptr(),
                1,
                k as isize,
                dy.as_ptr(),
                k as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        });
        time("c: W dY^T into scratch, transpose", &mut || {
            unsafe {
                gemm::gemm(
                    n,
                    m,
                    k,
                    scratch.as_mut_ptr(),
                    1,
                    m as isize,
                    false,
                    w.as_ptr(),
                    1,
                    k as isize,
                    dy.as_ptr(),
                    k as isize,
                    1,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    par,
                )
            }
            transpose::transpose(&scratch, &mut dx, m, n);
        });
        let mut dyt = vec![0.0f32; m * k];
        time("e: dY^T copy, W dY^T row-major, transpose", &mut || {
            transpose::transpose(&dy, &mut dyt, k, m);
            unsafe {
                gemm::gemm(
                    n,
                    m,
                    k,
                    scratch.as_mut_ptr(),
                    1,
                    m as isize,
                    false,
                    w.as_ptr(),
                    1,
                    k as isize,
                    dyt.as_ptr(),
                    1,
                    m as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    par,
                )
            }
            transpose::transpose(&scratch, &mut dx, m, n);
        });
        time("e': gemm part only", &mut || unsafe {
            gemm::gemm(
                n,
                m,
                k,
                scratch.as_mut_ptr(),
                1,
                m as isize,
                false,
                w.as_ptr(),
                1,
                k as isize,
                dyt.as_ptr(),
                1,
                m as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        });
        time("c': gemm part only", &mut || unsafe {
            gemm::gemm(
                n,
                m,
                k,
                scratch.as_mut_ptr(),
                1,
                m as isize,
                false,
                w.as_ptr(),
                1,
                k as isize,
                dy.as_ptr(),
                k as isize,
                1,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        });
        time("transpose out alone", &mut || {
            transpose::transpose(&scratch, &mut dx, m, n)
        });
        transpose::transpose(&w, &mut wt, k, n);
        time("d: dY Wt (cached transposed copy)", &mut || unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dx.as_mut_ptr(),
                1,
                n as isize,
                false,
                dy.as_ptr(),
                1,
                k as isize,
                wt.as_ptr(),
                1,
                n as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        });
        time("transpose W alone", &mut || {
            transpose::transpose(&w, &mut wt, k, n)
        });
        time("fwd: X W", &mut || unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dx.as_mut_ptr(),
                1,
                n as isize,
                false,
                dy.as_ptr(),
                1,
                k as isize,
                w.as_ptr(),
                1,
                n as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            )
        });
    });
}
