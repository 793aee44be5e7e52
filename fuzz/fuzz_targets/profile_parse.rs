//! Both profile formats (pipe's JSON, PipeDream's graph text) on arbitrary bytes: a profile
//! that passes its own checks, or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_scheduler::Profile;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(p) = Profile::from_json(&text) {
        assert!(p.check_file().is_ok());
    }
    if let Ok(p) = Profile::from_pipedream(&text) {
        assert!(p.check_file().is_ok());
    }
});
