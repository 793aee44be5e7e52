//! Token shards: what the writer puts in them is what windows read back, shard by shard and
//! never across a shard's end; the holdouts split where they say; the validation split is
//! thinned evenly; a text cut at safe points tokenizes as it would whole.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

mod common;

use pipe_stages::data::{Samples, token_corpus};
use pipe_stages::shards::{Holdout, ShardWriter, read_manifest, token_splits};
use pipe_stages::tokenizer::{TextTokenizer, is_safe_cut, split_at_safe_cuts};

/// A corpus of the ids `0..n` (as bytes) in shards of `per_shard`.
fn counting_corpus(name: &str, n: u32, per_shard: u64) -> PathBuf {
    let dir = common::fresh_path(name);
    let mut w = ShardWriter::create(&dir, &TextTokenizer::bytes(), per_shard).unwrap();
    let ids: Vec<u32> = (0..n).map(|i| i % 256).collect();
    w.push(&ids).unwrap();
    w.end_document().unwrap();
    w.finish().unwrap();
    dir
}

#[test]
fn windows_read_what_was_written_and_never_cross_a_shard() {
    // 100 ids in shards of 10: each shard holds (10 - 1) / 3 = 3 windows of 3.
    let dir = counting_corpus("windows", 100, 10);
    let m = read_manifest(&dir).unwrap();
    assert_eq!(m.shards.len(), 10);
    assert_eq!(m.tokens, 100);
    let (train, eval) = token_splits(&dir, 3, Holdout::Shards(2), 1000).unwrap();
    assert_eq!(train.len(), 8 * 3);
    assert_eq!(eval.len(), 2 * 3);
    let (mut x, mut y, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..train.len() {
        x.clear();
        y.clear();
        train.gather_into(i, &mut x, &mut y, &mut ids).unwrap();
        let (shard, w) = (i / 3, i % 3);
        let first = (shard * 10 + w * 3) as f32;
        assert_eq!(x, vec![first, first + 1.0, first + 2.0], "window {i}");
        assert_eq!(
            y,
            vec![first as u32 + 1, first as u32 + 2, first as u32 + 3]
        );
    }
    x.clear();
    y.clear();
    eval.gather_into(0, &mut x, &mut y, &mut ids).unwrap();
    assert_eq!(x[0], 80.0);
}

#[test]
fn the_tail_holdout_and_the_evaluation_budget_split_where_they_say() {
    // 1,001 ids in one shard: 250 windows of 4.
    let dir = counting_corpus("tail", 1001, 1 << 20);
    let (train, eval) = token_splits(&dir, 4, Holdout::Tail(0.1), 1000).unwrap();
    assert_eq!((train.len(), eval.len()), (225, 25));
    // Thinned to at most 10: every third of the 25, from the first.
    let (_, thin) = token_splits(&dir, 4, Holdout::Tail(0.1), 10).unwrap();
    assert_eq!(thin.len(), 9);
    let (mut x, mut y, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    thin.gather_into(1, &mut x, &mut y, &mut ids).unwrap();
    assert_eq!(x[0], ((225 + 3) * 4 % 256) as f32);

    let splits = token_corpus(&dir, 4, Holdout::Tail(0.1), 1000, None).unwrap();
    assert_eq!((splits.train.len(), splits.test.len()), (225, 25));
    assert_eq!(splits.train.classes, 256);
    assert!(matches!(splits.train.samples, Samples::Tokens(_)));
    let (x, y) = splits.train.gather(&[0, 224]).unwrap();
    assert_eq!(x.shape(), &[2, 4]);
    assert_eq!(y.len(), 8);
    assert!(splits.train.gather(&[225]).is_err());

    // A holdout that leaves nothing to train on.
    assert!(token_splits(&dir, 4, Holdout::Shards(1), 10).is_err());
    for bad in ["tail:0", "tail:1", "tail:x", "shards:0", "head:3", "tail"] {
        assert!(bad.parse::<Holdout>().is_err(), "{bad}");
    }
    assert_eq!("shards:2".parse::<Holdout>(), Ok(Holdout::Shards(2)));
}

#[test]
fn a_text_cut_at_safe_points_tokenizes_as_it_would_whole() {
    let text = "First Citizen:\nBefore we proceed\n\n\nany further, hear me.\n speak\nAll:\nSpeak, speak.\n";
    for at in 0..=text.len() {
        if is_safe_cut(text, at) {
            assert_eq!(&text[at - 1..at], "\n");
            assert!(!text[..at - 1].ends_with(char::is_whitespace));
            assert!(!text[at..].starts_with(char::is_whitespace));
        }
    }
    assert!(is_safe_cut(text, 15)); // before "Before"
    assert!(!is_safe_cut(text, 33)); // inside the run of blank lines
    let pieces = split_at_safe_cuts(text, 8);
    assert!(pieces.len() > 2, "{pieces:?}");
    assert_eq!(pieces.concat(), text);

    let bpe = TextTokenizer::from_file(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../data/tokenizers/shakespeare-bpe-1024.json"),
    )
    .unwrap();
    let whole = bpe.encode(text, "whole").unwrap();
    let cut: Vec<u32> = pieces
        .iter()
        .flat_map(|p| bpe.encode(p, "piece").unwrap())
        .collect();
    assert_eq!(cut, whole);
    assert_eq!(bpe.decode(&whole), text);
    assert_eq!(bpe.document_end(), Some(0));
}

/// Packed, a window's label whose input ends a document (the next document's first token) is
/// ignored; the inputs and every other label are as unpacked.
#[test]
fn packed_windows_ignore_the_label_after_each_document_end() {
    let dir = counting_corpus("packed", 100, 1 << 20);
    let (train, _) = token_splits(&dir, 3, Holdout::Tail(0.1), 1000).unwrap();
    let packed = train.clone().packed(Some(5));
    let (mut x, mut y, mut ids) = (Vec::new(), Vec::new(), Vec::new());
    packed.gather_into(1, &mut x, &mut y, &mut ids).unwrap();
    assert_eq!(x, vec![3.0, 4.0, 5.0]);
    assert_eq!(y, vec![4, 5, pipe_kernels::IGNORED_LABEL]);
    let (mut ux, mut uy) = (Vec::new(), Vec::new());
    train.gather_into(1, &mut ux, &mut uy, &mut ids).unwrap();
    assert_eq!((ux, uy), (x, vec![4, 5, 6]));
    assert_ne!(packed, train);
}
