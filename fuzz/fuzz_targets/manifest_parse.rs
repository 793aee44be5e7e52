//! A token corpus's manifest (`tokens.json`) on arbitrary bytes: one whose shards are plain
//! file names and whose counts add up, or an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_stages::shards::parse_manifest;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = parse_manifest(data, "fuzz") {
        assert!(!m.shards.is_empty());
        assert_eq!(m.shards.iter().map(|s| s.tokens).sum::<u64>(), m.tokens);
        for s in &m.shards {
            assert!(!s.file.contains('/') && s.file != "..", "{:?}", s.file);
        }
    }
});
