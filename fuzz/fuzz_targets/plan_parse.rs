//! A plan file (`pipe train --plan`) on arbitrary bytes: a checked plan or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_stages::config::PlanFile;

fuzz_target!(|data: &[u8]| {
    let _ = PlanFile::parse(&String::from_utf8_lossy(data), "fuzz.toml");
});
