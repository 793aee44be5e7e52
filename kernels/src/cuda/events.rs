//! The CUDA backend's marks ([`Backend::mark`](crate::Backend::mark)): CUDA events recorded on
//! its stream with timing, read when the stream has passed them (`cuEventElapsedTime` from an
//! origin event of the same context). `PIPE_CUDA_MARKS=0` turns marks off, so that a worker
//! waits for its stream after every action as before and one GPU session can time both.

use std::any::Any;

use cudarc::driver::{CudaEvent, CudaStream, sys as driver_sys};

use super::memory::driver_err;
use crate::marks::foreign_origin;
use crate::{DeviceMark, Result};

/// The environment variable that turns marks off (`0`).
pub(crate) const SWITCH: &str = "PIPE_CUDA_MARKS";

/// Whether this process marks (read once per backend, when it opens).
pub(crate) fn enabled() -> bool {
    std::env::var_os(SWITCH).is_none_or(|v| v != "0")
}

/// An event recorded on a backend's stream after the work queued so far.
#[derive(Debug)]
pub(crate) struct CudaMark(CudaEvent);

impl CudaMark {
    /// Records a timing event on `stream`.
    pub(crate) fn record(stream: &CudaStream) -> Result<CudaMark> {
        let flags = Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = stream.record_event(flags).map_err(driver_err("mark"))?;
        Ok(CudaMark(event))
    }
}

impl DeviceMark for CudaMark {
    fn passed(&self) -> Result<bool> {
        self.0.try_is_complete().map_err(driver_err("mark"))
    }

    fn seconds_since(&self, origin: &dyn DeviceMark) -> Result<f64> {
        let origin = origin
            .as_any()
            .downcast_ref::<CudaMark>()
            .ok_or_else(|| foreign_origin("a CUDA event", origin))?;
        let ms = origin.0.elapsed_ms(&self.0).map_err(driver_err("mark"))?;
        Ok(f64::from(ms) * 1e-3)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
