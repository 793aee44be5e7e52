use crate::{KernelError, Result, error::shape_err};

/// A dense tensor: a shape and contiguous row-major `f32` storage.
///
/// Two-dimensional views are used throughout: [`Tensor::rows`] is the product of all dimensions
/// but the last and [`Tensor::cols`] is the last dimension (a 1-D tensor is one row).
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
        }
    }

    /// A tensor with every element equal to `value`.
    pub fn full(shape: &[usize], value: f32) -> Self {
        Self {
            shape: shape.to_vec(),
            data: vec![value; shape.iter().product()],
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
        Ok(self)
    }

    /// Makes this tensor `shape`, reusing the allocation; contents are unspecified afterwards
    /// (zero where new storage was added).
    pub fn resize(&mut self, shape: &[usize]) {
        if self.shape != shape {
            self.shape.clear();
            self.shape.extend_from_slice(shape);
            self.data.resize(shape.iter().product(), 0.0);
        }
    }

    /// Sets every element to `value`.
    pub fn fill(&mut self, value: f32) {
        self.data.fill(value);
    }
}
