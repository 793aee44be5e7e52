//! The token shard reader (`PIPETOK1`) on arbitrary bytes: a shard whose length matches its
//! header's count and whose every id is inside its vocabulary, or an error; never a read past
//! the bytes or an allocation the header merely claims.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_stages::shards::parse_shard;

fuzz_target!(|data: &[u8]| {
    if let Ok((header, ids)) = parse_shard(data, "fuzz") {
        assert_eq!(ids.len() as u64, header.tokens);
        assert!(ids.iter().all(|&id| u64::from(id) < header.vocab_size));
    }
});
