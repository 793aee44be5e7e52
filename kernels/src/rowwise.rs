//! The CPU backend's loops over the rows of a matrix against one vector per column: the bias
//! added to every row, the rows summed into per-column totals (bias gradients), the layer
//! norm's parameter gradients, and `y += alpha x`.
//!
//! They move more than they compute, so each is written as a [`Kernel`] and run through
//! [`crate::vector::vectorized`]: compiled for the machine's widest vectors instead of the
//! workspace's SSE2 baseline, their stores and loads go 16 lanes at a time on AVX-512. Every
//! element is computed by the same operations in the same order as a plain loop would (the
//! columns lie across the lanes; each column's sum runs over the rows in order), so the bits
//! are the baseline's on every path.

use crate::vector::Kernel;

/// `rows[r][j] += bias[j]` for every row `r` (rows of `bias.len()` values).
pub(crate) struct AddBias<'a> {
    pub rows: &'a mut [f32],
    pub bias: &'a [f32],
}

impl Kernel for AddBias<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        for row in self.rows.chunks_exact_mut(self.bias.len()) {
            for (v, &b) in row.iter_mut().zip(self.bias) {
                *v += b;
            }
        }
    }
}

/// `sums[j] += rows[r][first + j]` over the rows in order (rows of `width` values).
pub(crate) struct ColumnSums<'a> {
    pub rows: &'a [f32],
    pub width: usize,
    /// The first column summed.
    pub first: usize,
    pub sums: &'a mut [f32],
}

impl Kernel for ColumnSums<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        for row in self.rows.chunks_exact(self.width) {
            for (acc, &v) in self.sums.iter_mut().zip(&row[self.first..]) {
                *acc += v;
            }
        }
    }
}

/// The layer norm's parameter gradients for columns `first..first + dgamma.len()`, added over
/// the rows in order: `dgamma[j] += dy * (x - mean) * rstd` and `dbeta[j] += dy`.
pub(crate) struct NormParamGrads<'a> {
    pub x: &'a [f32],
    pub dy: &'a [f32],
    pub mean: &'a [f32],
    pub rstd: &'a [f32],
    /// Values per row.
    pub width: usize,
    /// The first column of the block.
    pub first: usize,
    pub dgamma: &'a mut [f32],
    pub dbeta: &'a mut [f32],
}

impl Kernel for NormParamGrads<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let (w, c0) = (self.width, self.first);
        let rows = self
            .x
            .chunks_exact(w)
            .zip(self.dy.chunks_exact(w))
            .zip(self.mean.iter().zip(self.rstd));
        for ((xr, dyr), (&mu, &rs)) in rows {
            let each = self
                .dgamma
                .iter_mut()
                .zip(self.dbeta.iter_mut())
                .zip(&dyr[c0..])
                .zip(&xr[c0..]);
            for (((g, b), &d), &xv) in each {
                *g += d * (xv - mu) * rs;
                *b += d;
            }
        }
    }
}

/// `y[i] += alpha * x[i]`.
pub(crate) struct Axpy<'a> {
    pub alpha: f32,
    pub x: &'a [f32],
    pub y: &'a mut [f32],
}

impl Kernel for Axpy<'_> {
    type Output = ();

    #[inline(always)]
    fn run(self) {
        let alpha = self.alpha;
        self.y
            .iter_mut()
            .zip(self.x)
            .for_each(|(o, &v)| *o += alpha * v);
    }
}
