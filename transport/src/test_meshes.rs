//! What the regroup tests of every transport share: a mesh's survivors regrouped at once.

#![allow(clippy::unwrap_used)]

use crate::{Key, Kind, Transport};

/// The key of activation `index` from `from` to `to`.
pub fn key(from: u32, to: u32, index: u32) -> Key {
    Key {
        from,
        to,
        kind: Kind::Activation,
        stage: 0,
        index,
        step: 0,
    }
}

/// Each of `eps` regroups without `lost`, hosted by `host` where named, on a thread of its own;
/// the hosted rank's endpoint joins them, and all come back in rank order.
pub fn regroup_all(
    eps: Vec<Box<dyn Transport>>,
    lost: u32,
    host: Option<u32>,
) -> Vec<Box<dyn Transport>> {
    let threads: Vec<_> = eps
        .into_iter()
        .map(|mut ep| {
            ep.regroup_address().unwrap().unwrap();
            std::thread::spawn(move || ep.regroup(lost, host).unwrap())
        })
        .collect();
    let mut out: Vec<Box<dyn Transport>> = Vec::new();
    for t in threads {
        let (mesh, hosted) = t.join().unwrap();
        out.push(mesh);
        out.extend(hosted.map(|h| h as Box<dyn Transport>));
    }
    out.sort_by_key(|ep| ep.rank());
    out
}
