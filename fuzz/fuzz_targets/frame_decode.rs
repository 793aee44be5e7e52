//! The frame decoder on arbitrary bytes: it must return a message or an error, never panic,
//! hang or allocate more than the payload limit allows.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_transport::frame::{self, FrameLimits};

fuzz_target!(|data: &[u8]| {
    // A small payload limit, so that a frame claiming a large tensor is refused by the check
    // under test rather than by the fuzzer's memory limit.
    let limits = FrameLimits {
        run_id: 0x005e_ed0f_2026,
        max_payload_bytes: 1 << 20,
    };
    if let Ok(m) = frame::decode(data, &limits) {
        assert_eq!(m.tensor.len(), m.tensor.shape().iter().product::<usize>());
    }
});
