//! Clusters on disk: written, read back, used to connect; malformed files refused by name;
//! ranks from launchers' environments.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::thread;

use pipe_transport::cluster::{ClusterFile, resolve_rank};
use pipe_transport::quic::{Bound, QuicOptions};

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("pipe-cluster-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn an_initialised_cluster_connects_from_its_files() {
    let dir = scratch("connect");
    let addrs = vec!["127.0.0.1:0".to_string(), "127.0.0.1:0".to_string()];
    ClusterFile::init(&dir, &addrs, 42).unwrap();
    let file = ClusterFile::load(&dir.join("cluster.toml")).unwrap();
    assert_eq!((file.run_id, file.size()), (42, 2));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("rank-1.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "a private key readable by others");
    }
    // Port 0 in the file: bind each rank to a free port, then connect with those.
    let bound: Vec<Bound> = (0..2)
        .map(|r| {
            let creds = file.credentials(r).unwrap();
            let addr = file.addrs().unwrap()[r as usize];
            Bound::bind(r, addr, &creds, QuicOptions::new(file.run_id)).unwrap()
        })
        .collect();
    let addrs: Vec<_> = bound.iter().map(|b| b.local_addr().unwrap()).collect();
    let handles: Vec<_> = bound
        .into_iter()
        .map(|b| {
            let addrs = addrs.clone();
            thread::spawn(move || b.connect(&addrs).map(drop))
        })
        .collect();
    for h in handles {
        h.join().unwrap().unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn malformed_cluster_files_are_refused_by_name() {
    let dir = scratch("bad");
    ClusterFile::init(&dir, &["127.0.0.1:29400".to_string()], 1).unwrap();
    let toml = dir.join("cluster.toml");
    let good = std::fs::read_to_string(&toml).unwrap();
    for (text, needle) in [
        (good.replace("run_id", "run"), "unknown field"),
        (good.replace("[[worker]]", "[[workers]]"), "unknown field"),
        (
            "run_id = 1\nca = \"ca.pem\"\nworker = []\n".to_string(),
            "0 workers",
        ),
        ("garbage = [".to_string(), "cluster.toml"),
    ] {
        std::fs::write(&toml, &text).unwrap();
        let e = ClusterFile::load(&toml).unwrap_err().to_string();
        assert!(e.contains(needle) && e.contains("cluster.toml"), "{e}");
    }
    std::fs::write(&toml, &good).unwrap();
    let file = ClusterFile::load(&toml).unwrap();
    std::fs::write(dir.join("rank-0.key"), "not a key").unwrap();
    let e = file.credentials(0).unwrap_err().to_string();
    assert!(e.contains("rank-0.key"), "{e}");
    std::fs::write(dir.join("rank-0.pem"), vec![b'x'; 2 << 20]).unwrap();
    let e = file.credentials(0).unwrap_err().to_string();
    assert!(e.contains("rank-0.pem") && e.contains("bytes"), "{e}");
    assert!(
        file.credentials(5)
            .unwrap_err()
            .to_string()
            .contains("rank 5")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ranks_come_from_the_flag_or_the_launchers_variables() {
    let env = |pairs: &[(&str, &str)]| {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    };
    assert_eq!(resolve_rank(Some(3), env(&[("RANK", "1")]), 4), Ok(3));
    assert_eq!(resolve_rank(None, env(&[("SLURM_PROCID", "2")]), 4), Ok(2));
    assert_eq!(
        resolve_rank(None, env(&[("JOB_COMPLETION_INDEX", "1")]), 4),
        Ok(1)
    );
    // torchrun inside Slurm: the process rank, not the node's task.
    assert_eq!(
        resolve_rank(None, env(&[("SLURM_PROCID", "0"), ("RANK", "3")]), 4),
        Ok(3)
    );
    assert_eq!(
        resolve_rank(None, env(&[("PIPE_RANK", "0"), ("RANK", "3")]), 4),
        Ok(0)
    );
    assert!(
        resolve_rank(None, env(&[]), 4)
            .unwrap_err()
            .contains("no rank")
    );
    assert!(
        resolve_rank(None, env(&[("RANK", "x")]), 4)
            .unwrap_err()
            .contains("RANK")
    );
    assert!(
        resolve_rank(None, env(&[("RANK", "4")]), 4)
            .unwrap_err()
            .contains("cluster of 4")
    );
}
