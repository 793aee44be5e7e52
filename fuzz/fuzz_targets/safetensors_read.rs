//! The Hugging Face weights reader on arbitrary bytes: tensors whose values fill their shapes
//! and are finite, or an error; never a read past the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_stages::hf::read_weights;

fuzz_target!(|data: &[u8]| {
    if let Ok(tensors) = read_weights(data, "fuzz") {
        for (_, full, t) in tensors {
            assert!(full.starts_with("transformer.") || full == "lm_head.weight");
            let values = t.host().expect("a host tensor");
            assert_eq!(values.len(), t.shape().iter().product::<usize>());
            assert!(values.iter().all(|v| v.is_finite()));
        }
    }
});
