//! The criterion benches' results (`cargo bench` writes them under `target/criterion`) and
//! numpy's GEMM figures (`experiments/gemm-vs-numpy/numpy_gemm.py --json`), read into the
//! report's summary. Nothing here measures; it only reads what those commands left.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::ExperimentError;

/// One criterion benchmark's median.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CriterionFigure {
    /// `group/function/parameter` as criterion names it.
    pub id: String,
    /// Median time per iteration, seconds.
    pub median_s: f64,
    /// Lower and upper bound of criterion's confidence interval of the median, seconds.
    pub interval_s: [f64; 2],
    /// Throughput per second when the bench declares one (elements or bytes).
    pub throughput: Option<f64>,
    /// `elements` or `bytes`.
    pub throughput_unit: Option<String>,
}

#[derive(Deserialize)]
struct Estimate {
    point_estimate: f64,
    confidence_interval: Interval,
}

#[derive(Deserialize)]
struct Interval {
    lower_bound: f64,
    upper_bound: f64,
}

#[derive(Deserialize)]
struct Estimates {
    median: Estimate,
}

#[derive(Deserialize)]
struct BenchmarkFile {
    full_id: String,
    #[serde(default)]
    throughput: Option<serde_json::Value>,
}

/// Every benchmark under `dir` (criterion's output directory), sorted by id.
///
/// # Errors
/// An unreadable directory or a malformed criterion file (named).
pub fn read_criterion(dir: &Path) -> Result<Vec<CriterionFigure>, ExperimentError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    let err = |p: &Path, e: String| ExperimentError::Config(format!("{}: {e}", p.display()));
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| err(&d, e.to_string()))?;
        for entry in entries {
            let path = entry.map_err(|e| err(&d, e.to_string()))?.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n == "new") {
                    if let Some(f) = read_one(&path)? {
                        out.push(f);
                    }
                } else if path
                    .file_name()
                    .is_none_or(|n| n != "base" && n != "report")
                {
                    stack.push(path);
                }
            }
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// One `new/` directory: `None` when it lacks the two files.
fn read_one(dir: &Path) -> Result<Option<CriterionFigure>, ExperimentError> {
    let (est_path, bench_path) = (dir.join("estimates.json"), dir.join("benchmark.json"));
    if !est_path.is_file() || !bench_path.is_file() {
        return Ok(None);
    }
    let read = |p: &Path| crate::read_results_file(p);
    let bad = |p: &Path, e: serde_json::Error| {
        ExperimentError::Config(format!("{}: not a criterion file: {e}", p.display()))
    };
    let est: Estimates = serde_json::from_str(&read(&est_path)?).map_err(|e| bad(&est_path, e))?;
    let bench: BenchmarkFile =
        serde_json::from_str(&read(&bench_path)?).map_err(|e| bad(&bench_path, e))?;
    let median_s = est.median.point_estimate * 1e-9;
    // `{"Elements": n}` or `{"Bytes": n}` (other forms are left out).
    let declared = bench
        .throughput
        .as_ref()
        .and_then(|t| t.as_object())
        .and_then(|o| o.iter().next())
        .and_then(|(unit, n)| Some((unit.to_lowercase(), n.as_f64()?)));
    let (throughput, throughput_unit) = match declared {
        Some((unit, per_iter)) if median_s > 0.0 => (Some(per_iter / median_s), Some(unit)),
        _ => (None, None),
    };
    Ok(Some(CriterionFigure {
        id: bench.full_id,
        median_s,
        interval_s: [
            est.median.confidence_interval.lower_bound * 1e-9,
            est.median.confidence_interval.upper_bound * 1e-9,
        ],
        throughput,
        throughput_unit,
    }))
}

/// One row of numpy's GEMM comparison.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NumpyRow {
    /// Shape name (`fwd_b64_w1024`).
    pub shape: String,
    /// Threads both sides used.
    pub threads: u32,
    /// pipe's GFLOP/s (criterion median).
    pub pipe_gflops: f64,
    /// numpy's GFLOP/s (median).
    pub numpy_gflops: f64,
    /// pipe over numpy.
    pub ratio: f64,
}

/// numpy's GEMM figures, as `numpy_gemm.py --json` writes them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NumpyFigures {
    /// numpy and BLAS versions.
    pub numpy: String,
    /// The rows.
    pub rows: Vec<NumpyRow>,
}

/// Reads a `numpy_gemm.py --json` file.
///
/// # Errors
/// An unreadable or malformed file, or one with a non-finite or non-positive figure.
pub fn read_numpy(path: &Path) -> Result<NumpyFigures, ExperimentError> {
    let text = crate::read_results_file(path)?;
    let f: NumpyFigures = serde_json::from_str(&text)
        .map_err(|e| ExperimentError::Config(format!("{}: {e}", path.display())))?;
    if f.rows.is_empty() {
        return Err(ExperimentError::Config(format!(
            "{}: no rows",
            path.display()
        )));
    }
    for r in &f.rows {
        let ok = |v: f64| v.is_finite() && v > 0.0;
        if !(ok(r.pipe_gflops) && ok(r.numpy_gflops) && ok(r.ratio)) {
            return Err(ExperimentError::Config(format!(
                "{}: row {} has a non-positive or non-finite figure",
                path.display(),
                r.shape
            )));
        }
    }
    Ok(f)
}
