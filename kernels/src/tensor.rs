use std::sync::atomic::{AtomicU64, Ordering};

use crate::{KernelError, Result, error::shape_err};

/// Source of content stamps: every new or mutably borrowed tensor gets the next value.
static STAMPS: AtomicU64 = AtomicU64::new(1);

fn next_stamp() -> u64 {
    STAMPS.fetch_add(1, Ordering::Relaxed)
}

/// A dense tensor: a shape and contiguous row-major `f32` storage.
///
/// Two-dimensional views are used throughout: [`Tensor::rows`] is the product of all dimensions
/// but the last and [`Tensor::cols`] is the last dimension (a 1-D tensor is one row).
///
/// Every tensor carries a content stamp ([`Tensor::stamp`]): a process-wide unique number that
/// changes whenever the contents may change (any mutable access) and is shared by clones, which
/// hold the same contents. Backends key caches of derived data (packed GEMM operands) on it.
#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
    stamp: u64,
}

impl Default for Tensor {
    fn default() -> Self {
        Self {
            shape: Vec::new(),
            data: Vec::new(),
            stamp: next_stamp(),
        }
    }
}

impl PartialEq for Tensor {
    /// Shapes and elements equal (the stamp is not compared).
    fn eq(&self, other: &Self) -> bool {
        self.shape == other.shape && self.data == other.data
    }
}

impl Tensor {
    /// The content stamp: equal stamps mean equal contents (see the type's docs).
    pub fn stamp(&self) -> u64 {
        self.stamp
    }

    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
            stamp: next_stamp(),
        }
    }

    /// A tensor with every element equal to `value`.
    pub fn full(shape: &[usize], value: f32) -> Self {
        Self {
            shape: shape.to_vec(),
            data: vec![value; shape.iter().product()],
            stamp: next_stamp(),
        }
    }

    /// Wraps `data` with `shape`.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the element count differs from the shape's product.
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        let want: usize = shape.iter().product();
        if want != data.len() {
            return Err(shape_err(
                "from_vec",
                format!("shape {shape:?} needs {want} elements, got {}", data.len()),
            ));
        }
        Ok(Self {
            shape: shape.to_vec(),
            data,
            stamp: next_stamp(),
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Rows of the 2-D view (product of all dimensions but the last; 1 for a scalar or vector).
    pub fn rows(&self) -> usize {
        match self.shape.len() {
            0 | 1 => 1,
            n => self.shape[..n - 1].iter().product(),
        }
    }

    /// Columns of the 2-D view (the last dimension; 1 for a scalar).
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// The elements, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The elements, row-major, mutably.
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.stamp = next_stamp();
        &mut self.data
    }

    /// Gives the storage back.
    pub fn into_vec(self) -> Vec<f32> {
        self.data
    }

    /// Changes the shape keeping the elements.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when the element count would change.
    pub fn reshape(mut self, shape: &[usize]) -> Result<Self> {
        let want: usize = shape.iter().product();
        if want != self.data.len() {
            return Err(KernelError::Shape {
                op: "reshape",
                detail: format!("cannot view {:?} as {shape:?}", self.shape),
            });
        }
        self.shape = shape.to_vec();
        self.stamp = next_stamp();
        Ok(self)
    }

    /// Makes this tensor `shape`, reusing the allocation; contents are unspecified afterwards
    /// (zero where new storage was added).
    pub fn resize(&mut self, shape: &[usize]) {
        self.stamp = next_stamp();
        if self.shape != shape {
            self.shape.clear();
            self.shape.extend_from_slice(shape);
            self.data.resize(shape.iter().product(), 0.0);
        }
    }

    /// Sets every element to `value`.
    pub fn fill(&mut self, value: f32) {
        self.stamp = next_stamp();
        self.data.fill(value);
    }
}
