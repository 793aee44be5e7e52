//! The IDX reader (MNIST's format) on arbitrary bytes: a file whose data matches its
//! dimensions, or an error; never an allocation the dimensions merely claim.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_stages::data::parse_idx;

fuzz_target!(|data: &[u8]| {
    if let Ok(idx) = parse_idx(data, "fuzz") {
        assert_eq!(idx.data.len(), idx.dims.iter().product::<usize>());
    }
});
