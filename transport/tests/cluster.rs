//! Clusters on disk: written, read back, used to connect; malformed files refused by name;
//! ranks from launchers' environments.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::thread;

use pipe_transport::cluster::{ClusterFile, Existing, resolve_rank};
use pipe_transport::quic::{Bound, QuicOptions};

#[path = "../../tests/common/scratch.rs"]
mod scratch;

fn scratch(name: &str) -> std::path::PathBuf {
    scratch::fresh_path(name)
}

#[test]
fn an_initialised_cluster_connects_from_its_files() {
    let dir = scratch("connect");
    let addrs = vec!["127.0.0.1:0".to_string(), "127.0.0.1:0".to_string()];
    ClusterFile::init(&dir, &addrs, 42, Existing::Refuse).unwrap();
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

/// Spaces around an address are the edge's to remove: the file holds the trimmed address,
/// a file written by hand with them reads as trimmed, and both resolve (a kept space made
/// the worker wait out its connect timeout on an address that never resolves).
#[test]
fn addresses_are_kept_and_read_trimmed() {
    let dir = scratch("trimmed");
    let addrs = vec![
        " 127.0.0.1:29400".to_string(),
        "127.0.0.1:29401 \t".to_string(),
    ];
    ClusterFile::init(&dir, &addrs, 7, Existing::Refuse).unwrap();
    let text = std::fs::read_to_string(dir.join("cluster.toml")).unwrap();
    assert!(text.contains("\"127.0.0.1:29400\"") && text.contains("\"127.0.0.1:29401\""));
    let want: Vec<std::net::SocketAddr> = vec![
        "127.0.0.1:29400".parse().unwrap(),
        "127.0.0.1:29401".parse().unwrap(),
    ];
    assert_eq!(
        ClusterFile::load(&dir.join("cluster.toml"))
            .unwrap()
            .addrs()
            .unwrap(),
        want
    );
    let spaced = text.replace("\"127.0.0.1:29400\"", "\"  127.0.0.1:29400 \"");
    assert_ne!(spaced, text);
    let file = ClusterFile::parse(&spaced, "spaced", &dir).unwrap();
    assert_eq!(file.addrs().unwrap(), want);
    // Two ranks at one address once trimmed.
    let twice = vec![
        "127.0.0.1:29400".to_string(),
        " 127.0.0.1:29400".to_string(),
    ];
    let err = ClusterFile::init(&scratch("twice"), &twice, 7, Existing::Refuse).unwrap_err();
    assert!(err.to_string().contains("both at 127.0.0.1:29400"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn malformed_cluster_files_are_refused_by_name() {
    let dir = scratch("bad");
    ClusterFile::init(&dir, &["127.0.0.1:29400".to_string()], 1, Existing::Refuse).unwrap();
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

/// The bytes of every file under `dir`, by name: what a refused command must leave as it was.
fn contents(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let mut all: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            (name, std::fs::read(e.path()).unwrap())
        })
        .collect();
    all.sort();
    all
}

#[test]
fn init_refuses_an_existing_cluster_and_replaces_it_whole_when_forced() {
    let dir = scratch("existing");
    let two = ["127.0.0.1:29400".to_string(), "127.0.0.1:29401".to_string()];
    ClusterFile::init(&dir, &two, 1, Existing::Refuse).unwrap();
    let before = contents(&dir);
    let e = ClusterFile::init(&dir, &two[..1], 2, Existing::Refuse)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not empty") && e.contains("--force"), "{e}");
    assert_eq!(contents(&dir), before, "a refused init leaves every byte");
    // Two ranks at one address are refused before anything is written.
    let same = ["10.0.0.1:29400".to_string(), "10.0.0.1:29400".to_string()];
    let e = ClusterFile::init(&dir, &same, 3, Existing::Replace)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("ranks 0 and 1") && e.contains("10.0.0.1:29400"),
        "{e}"
    );
    assert_eq!(contents(&dir), before);
    // Forced over a directory that holds anything but a cluster's files: refused, untouched.
    for foreign in ["notes.txt", "sub", "rank-x.pem"] {
        let path = dir.join(foreign);
        if foreign == "sub" {
            std::fs::create_dir(&path).unwrap();
        } else {
            std::fs::write(&path, b"mine").unwrap();
        }
        let e = ClusterFile::init(&dir, &two[..1], 5, Existing::Replace)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(foreign) && e.contains("not a file of a cluster"),
            "{e}"
        );
        assert!(path.exists() && dir.join("ca.pem").exists());
        let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir(&path));
    }
    assert_eq!(contents(&dir), before);
    // Forced: one rank, a new CA, and no file of the old cluster left.
    let file = ClusterFile::init(&dir, &two[..1], 4, Existing::Replace).unwrap();
    assert_eq!((file.run_id, file.size()), (4, 1));
    let names: Vec<String> = contents(&dir).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        ["ca.pem", "cluster.toml", "rank-0.key", "rank-0.pem"]
    );
    assert_ne!(std::fs::read(dir.join("ca.pem")).unwrap(), before[0].1);
    let parent = dir.parent().unwrap();
    let leftovers = std::fs::read_dir(parent)
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".pipe-cluster-existing")
        })
        .count();
    assert_eq!(
        leftovers, 0,
        "no staging or old directory is left beside it"
    );
    // A file naming two ranks at one address is refused when it is loaded.
    let toml = dir.join("cluster.toml");
    let text = std::fs::read_to_string(&toml).unwrap();
    let doubled = format!(
        "{text}\n[[worker]]\naddr = \"127.0.0.1:29400\"\ncert = \"rank-0.pem\"\nkey = \"rank-0.key\"\n"
    );
    std::fs::write(&toml, doubled).unwrap();
    let e = ClusterFile::load(&toml).unwrap_err().to_string();
    assert!(
        e.contains("ranks 0 and 1 are both at 127.0.0.1:29400"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--out LINK`: the cluster goes into the directory the link names, and the link stays a
/// link, whether the directory is new or replaced; a link that names nothing is refused.
#[cfg(unix)]
#[test]
fn a_link_to_a_directory_stands_for_it() {
    let real = scratch("linked-real");
    std::fs::create_dir_all(&real).unwrap();
    let link = scratch("linked-link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let two = ["127.0.0.1:29400".to_string(), "127.0.0.1:29401".to_string()];
    for (run, existing) in [(1, Existing::Refuse), (2, Existing::Replace)] {
        let file = ClusterFile::init(&link, &two, run, existing).unwrap();
        assert_eq!(file.run_id, run);
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        let toml = std::fs::read_to_string(real.join("cluster.toml")).unwrap();
        assert!(toml.contains(&format!("run_id = {run}")), "{toml}");
    }
    let dangling = scratch("linked-dangling");
    std::os::unix::fs::symlink(scratch("linked-nowhere"), &dangling).unwrap();
    let e = ClusterFile::init(&dangling, &two, 3, Existing::Refuse)
        .unwrap_err()
        .to_string();
    assert!(e.contains("names nothing usable"), "{e}");
    for p in [&link, &dangling] {
        std::fs::remove_file(p).unwrap();
    }
    std::fs::remove_dir_all(&real).unwrap();
}

#[cfg(unix)]
#[test]
fn a_cluster_file_or_certificate_that_is_a_fifo_is_refused_not_waited_on() {
    let dir = scratch("fifo");
    ClusterFile::init(&dir, &["127.0.0.1:29400".to_string()], 1, Existing::Refuse).unwrap();
    let file = ClusterFile::load(&dir.join("cluster.toml")).unwrap();
    std::fs::remove_file(dir.join("ca.pem")).unwrap();
    let fifo = dir.join("ca.pem");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let e = file.credentials(0).unwrap_err().to_string();
    assert!(e.contains("ca.pem") && e.contains("FIFO"), "{e}");
    let toml = dir.join("cluster.toml");
    std::fs::remove_file(&toml).unwrap();
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&toml)
            .status()
            .unwrap()
            .success()
    );
    let e = ClusterFile::load(&toml).unwrap_err().to_string();
    assert!(e.contains("cluster.toml") && e.contains("FIFO"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn addresses_that_name_no_host_are_refused_and_long_directory_names_are_written() {
    let dir = scratch("hosts");
    for bad in [
        "a b:29400",
        "host\n:29400",
        "[::1:29400",
        "[nonsense]:29400",
        ":29400",
    ] {
        let addrs = [bad.to_string(), "127.0.0.1:29401".to_string()];
        let e = ClusterFile::init(&dir, &addrs, 1, Existing::Refuse).unwrap_err();
        assert!(
            e.is_bad_input() && e.to_string().contains("is not host:port"),
            "{e}"
        );
        assert!(!dir.exists(), "{bad}: nothing written");
    }
    let good = ["node-1.example_net:29400", "10.0.0.2:29400", "[::1]:29400"];
    let good: Vec<String> = good.iter().map(ToString::to_string).collect();
    ClusterFile::init(&dir, &good, 1, Existing::Refuse).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    // A directory name of about 245 bytes, legal, where its staging name would not be.
    let name = format!("{}-{}", "d".repeat(238), std::process::id());
    let long = scratch("long").with_file_name(name);
    let _ = std::fs::remove_dir_all(&long);
    ClusterFile::init(&long, &good, 1, Existing::Refuse).unwrap();
    assert!(long.join("cluster.toml").is_file());
    ClusterFile::init(&long, &good, 2, Existing::Replace).unwrap();
    let left: Vec<_> = std::fs::read_dir(long.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".ddddd"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&long).unwrap();
}
