//! A cluster file (`pipe worker --cluster`, `pipe plan --cluster`) on arbitrary bytes: a
//! checked cluster (every rank at its own address) or an error naming the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_transport::cluster::ClusterFile;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(file) = ClusterFile::parse(&text, "fuzz.toml", std::path::Path::new(".")) {
        assert!(file.size() >= 1);
    }
});
