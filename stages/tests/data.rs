//! The IDX reader accepts MNIST and rejects malformed files with a message naming the problem.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;

mod common;

use pipe_stages::StageError;
use pipe_stages::data::{SyntheticConfig, mnist, parse_idx, read_idx, synthetic};

fn idx(dims: &[u32], body: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        v.extend_from_slice(&d.to_be_bytes());
    }
    v.extend_from_slice(body);
    v
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn reason(e: StageError) -> String {
    match e {
        StageError::Data { reason, .. } => reason,
        other => panic!("expected a data error, got {other}"),
    }
}

#[test]
fn parses_raw_and_gzip() {
    let raw = idx(&[2, 3], &[1, 2, 3, 4, 5, 6]);
    let a = parse_idx(&raw, "t").unwrap();
    assert_eq!(a.dims, vec![2, 3]);
    assert_eq!(a.data, vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(parse_idx(&gzip(&raw), "t").unwrap(), a);
}

#[test]
fn rejects_malformed_files() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "truncated"),
        (vec![0, 0, 8], "truncated"),
        (vec![1, 2, 8, 1, 0, 0, 0, 1, 0], "bad magic"),
        (
            idx(&[2], &[1, 2])
                .into_iter()
                .enumerate()
                .map(|(i, b)| if i == 2 { 0x0d } else { b })
                .collect(),
            "type code",
        ),
        (vec![0, 0, 8, 0], "rank 0"),
        (vec![0, 0, 8, 9], "rank 9"),
        (vec![0, 0, 8, 2, 0, 0, 0, 2], "truncated header"),
        (idx(&[2, 3], &[1, 2, 3]), "truncated"),
        (idx(&[2, 3], &[1, 2, 3, 4, 5, 6, 7]), "trailing"),
        (idx(&[0], &[]), "zero"),
        (
            idx(&[u32::MAX, u32::MAX, u32::MAX], &[]),
            "more data than allowed",
        ),
        (vec![0x1f, 0x8b, 8, 0, 1, 2, 3], "corrupt gzip"),
    ];
    for (bytes, want) in cases {
        let msg = reason(parse_idx(&bytes, "case").unwrap_err());
        assert!(msg.contains(want), "expected '{want}' in '{msg}'");
    }
    // A truncated gzip of a valid file is caught too.
    let gz = gzip(&idx(&[4, 4], &[7; 16]));
    assert!(parse_idx(&gz[..gz.len() - 6], "cut").is_err());
}

#[test]
fn missing_files_and_dirs_are_errors() {
    let dir = common::fresh_dir("mnist");
    let e = mnist(Some(&dir)).unwrap_err();
    assert!(reason(e).contains("missing"));
    let f = dir.join("x.idx");
    std::fs::write(&f, idx(&[3], &[1, 2])).unwrap();
    assert!(reason(read_idx(&f).unwrap_err()).contains("truncated"));
    // Images and labels that disagree in count.
    std::fs::write(
        dir.join("train-images-idx3-ubyte"),
        idx(&[2, 2, 2], &[0; 8]),
    )
    .unwrap();
    std::fs::write(dir.join("train-labels-idx1-ubyte"), idx(&[3], &[0, 1, 2])).unwrap();
    let msg = reason(mnist(Some(&dir)).unwrap_err());
    assert!(msg.contains("2 images but 3 labels"), "{msg}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn embedded_mnist_is_complete() {
    let s = mnist(None).unwrap();
    assert_eq!(s.train.len(), 60_000);
    assert_eq!(s.test.len(), 10_000);
    assert_eq!(s.train.feature_shape, vec![28, 28]);
    let mut counts = [0usize; 10];
    let (_, labels) = s.test.gather(&(0..10_000).collect::<Vec<u32>>()).unwrap();
    for &l in labels.host().unwrap() {
        counts[l as usize] += 1;
    }
    assert_eq!(
        counts,
        [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    );
}

#[test]
fn shuffling_and_synthetic_data_are_seeded() {
    let cfg = SyntheticConfig {
        inputs: 16,
        classes: 4,
        hidden: 8,
        train: 256,
        test: 64,
    };
    let a = synthetic(&cfg, 3).unwrap();
    let b = synthetic(&cfg, 3).unwrap();
    let c = synthetic(&cfg, 4).unwrap();
    assert_eq!(a.train, b.train);
    assert_ne!(a.train.samples, c.train.samples);
    // Every class appears: the teacher is not degenerate.
    let all: Vec<u32> = (0..256).collect();
    let (_, labels) = a.train.gather(&all).unwrap();
    for k in 0..4 {
        assert!(labels.host().unwrap().contains(&k), "class {k} missing");
    }
    let o1 = a
        .train
        .epoch_order(1, 1, pipe_stages::data::DataOrder::Shuffled);
    assert_eq!(
        o1,
        a.train
            .epoch_order(1, 1, pipe_stages::data::DataOrder::Shuffled)
    );
    assert_ne!(
        o1,
        a.train
            .epoch_order(1, 2, pipe_stages::data::DataOrder::Shuffled)
    );
    // The stored order, every epoch alike.
    let stored = a
        .train
        .epoch_order(1, 2, pipe_stages::data::DataOrder::Sequential);
    assert!(stored.iter().enumerate().all(|(i, &s)| s as usize == i));
    assert_eq!(
        stored,
        a.train
            .epoch_order(5, 3, pipe_stages::data::DataOrder::Sequential)
    );
    let mut sorted = o1.clone();
    sorted.sort();
    assert_eq!(sorted, (0..256).collect::<Vec<u32>>());
    let (x, y) = a.train.gather(&o1[..8]).unwrap();
    assert_eq!(x.shape(), &[8, 16]);
    assert_eq!(y.len(), 8);
    assert!(synthetic(&SyntheticConfig { classes: 1, ..cfg }, 0).is_err());
}

/// A character vocabulary read from a file must be sorted with each character once, as the
/// search that encodes text needs: an unsorted one gave false "not in the vocabulary" errors.
#[test]
fn a_character_vocabulary_read_unsorted_or_with_a_repeat_is_refused() {
    use pipe_stages::data::Vocab;
    let good: Vocab = serde_json::from_str(r#"{"chars": ["\n", " ", "a", "b"]}"#).unwrap();
    assert_eq!(good.encode("ab a", "text").unwrap(), vec![2, 3, 1, 2]);
    for (text, want) in [
        (r#"{"chars": ["b", "a"]}"#, "'b' comes before 'a'"),
        (r#"{"chars": ["a", "a"]}"#, "'a' comes before 'a'"),
    ] {
        let err = serde_json::from_str::<Vocab>(text).unwrap_err().to_string();
        assert!(
            err.contains("must be sorted") && err.contains(want),
            "{err}"
        );
    }
}
