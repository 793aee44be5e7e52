//! A cluster on disk: the CA, one certificate and key per rank, and `cluster.toml` naming the
//! run and each rank's address (what `pipe cluster init` writes and `pipe worker` reads), and
//! where a worker's rank comes from when a launcher starts it.
//!
//! ```toml
//! run_id = 1234567890
//! ca = "ca.pem"
//!
//! [[worker]]
//! addr = "10.0.0.1:29400"
//! cert = "rank-0.pem"
//! key = "rank-0.key"
//! ```
//!
//! Paths are relative to the file's directory; `[[worker]]` entries are in rank order. Every
//! file is read with a size bound and parsed strictly: a missing, oversized or malformed file
//! is an error naming it.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::{Deserialize, Serialize};

use crate::TransportError;

/// Largest cluster file or PEM file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Largest cluster.
pub const MAX_WORKERS: u32 = 4096;

/// One rank's entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerEntry {
    /// Where peers reach this rank (`host:port`).
    pub addr: String,
    /// Its certificate (PEM), relative to the cluster file.
    pub cert: PathBuf,
    /// Its private key (PEM), relative to the cluster file.
    pub key: PathBuf,
}

/// `cluster.toml`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// The run every worker and frame belongs to.
    pub run_id: u64,
    /// The cluster CA certificate (PEM).
    pub ca: PathBuf,
    /// Ranks in order.
    #[serde(rename = "worker")]
    pub workers: Vec<WorkerEntry>,
    /// The directory paths are relative to (the file's own).
    #[serde(skip)]
    pub dir: PathBuf,
}

fn setup(msg: String) -> TransportError {
    TransportError::Setup(msg)
}

fn bad_file(msg: String) -> TransportError {
    TransportError::BadFile(msg)
}

/// A regular file's bytes, refusing anything over [`MAX_FILE_BYTES`] before reading it.
fn read_bounded(path: &Path) -> Result<Vec<u8>, TransportError> {
    use pipe_kernels::files::ReadError;
    pipe_kernels::files::read_bounded(path, MAX_FILE_BYTES).map_err(|e| match e {
        ReadError::Io(e) => bad_file(format!("{}: {e}", path.display())),
        ReadError::Long { .. } => bad_file(format!(
            "{}: more than the {MAX_FILE_BYTES} bytes a cluster file may have",
            path.display()
        )),
    })
}

/// Writes `bytes` to `path`, readable by its owner only when `private`.
fn write_file(path: &Path, bytes: &[u8], private: bool) -> Result<(), TransportError> {
    let err = |e: std::io::Error| setup(format!("{}: {e}", path.display()));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if private {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let _ = private;
    let mut f = options.open(path).map_err(err)?;
    std::io::Write::write_all(&mut f, bytes).map_err(err)
}

/// A path beside `dir` for this process to stage or move aside into: `.NAME.KIND-PID`.
fn sibling(dir: &Path, kind: &str) -> Result<PathBuf, TransportError> {
    let name = dir
        .file_name()
        .ok_or_else(|| bad_file(format!("{}: not a directory name", dir.display())))?;
    let parent = pipe_kernels::files::parent_dir(dir);
    Ok(parent.join(format!(
        ".{}.{kind}-{}",
        pipe_kernels::files::temporary_stem(&name.to_string_lossy()),
        std::process::id()
    )))
}

/// Puts the directory `staging` in `dir`'s place: renamed over a missing or empty `dir`, or,
/// where `dir` holds something, after moving the old one aside (removed once the new one is
/// in place).
fn replace_dir(staging: &Path, dir: &Path) -> Result<(), TransportError> {
    let err = |p: &Path, e: std::io::Error| setup(format!("{}: {e}", p.display()));
    let _ = std::fs::remove_dir(dir);
    if !dir.exists() {
        return std::fs::rename(staging, dir).map_err(|e| err(dir, e));
    }
    let old = sibling(dir, "old")?;
    let _ = std::fs::remove_dir_all(&old);
    std::fs::rename(dir, &old).map_err(|e| err(dir, e))?;
    std::fs::rename(staging, dir).map_err(|e| err(dir, e))?;
    std::fs::remove_dir_all(&old).map_err(|e| err(&old, e))
}

/// Whether `name` is a file [`ClusterFile::init`] writes: `ca.pem`, `cluster.toml`,
/// `rank-K.pem` or `rank-K.key`.
fn is_cluster_file(name: &str) -> bool {
    let rank_file = |ext: &str| {
        name.strip_prefix("rank-")
            .and_then(|rest| rest.strip_suffix(ext))
            .is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
    };
    matches!(name, "ca.pem" | "cluster.toml") || rank_file(".pem") || rank_file(".key")
}

/// Refuses to replace `dir` where it holds anything but a cluster's own files (a directory,
/// a link, a file of another name): `--force` replaces a cluster, and a directory of the
/// user's given by mistake (a home directory) must not be removed with it.
fn refuse_foreign_entries(dir: &Path) -> Result<(), TransportError> {
    let entries = std::fs::read_dir(dir).map_err(|e| setup(format!("{}: {e}", dir.display())))?;
    for entry in entries {
        let entry = entry.map_err(|e| setup(format!("{}: {e}", dir.display())))?;
        let name = entry.file_name();
        let is_file = entry.file_type().is_ok_and(|t| t.is_file());
        if !is_file || !name.to_str().is_some_and(is_cluster_file) {
            return Err(bad_file(format!(
                "{}: holds {}, which is not a file of a cluster: --force replaces a cluster's \
                 directory whole, and nothing else (give the cluster's own directory, or a new one)",
                dir.display(),
                name.to_string_lossy()
            )));
        }
    }
    Ok(())
}

/// What [`ClusterFile::init`] does with a cluster directory that exists and is not empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    /// Refuse: its credentials may be deployed on workers already.
    Refuse,
    /// Replace it whole (`pipe cluster init --force`): nothing of the old cluster is left. A
    /// directory holding anything but a cluster's files is refused all the same.
    Replace,
}

/// Whether `host` can name a host: a name of letters, digits, `-`, `_` and `.`, an IPv4
/// address, or an IPv6 address in brackets. A name of digits and dots alone is an IPv4
/// address or nothing (no top-level domain is all digits), so `999.1.1.1` or `10.0.0` is
/// refused here rather than left to a resolver, and a connection, to time out on.
pub fn is_host(host: &str) -> bool {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None if host.chars().all(|c| c.is_ascii_digit() || c == '.') => {
            host.parse::<std::net::Ipv4Addr>().is_ok()
        }
        None => {
            // A DNS name is at most 255 characters, as `pipe bench hosts` holds its names.
            (1..=255).contains(&host.len())
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        }
    }
}

/// Checks every rank's address, as `pipe cluster init` takes them and as a cluster file is
/// read: each a `host:port` (a name or an IP address, and a port number), and no two ranks at
/// one address (port 0, "any free port", is a launcher's to assign). Names are resolved only
/// when a worker connects ([`ClusterFile::addrs`]).
fn check_addrs<'a>(addrs: impl Iterator<Item = &'a str>, what: &str) -> Result<(), TransportError> {
    let mut seen = std::collections::HashMap::new();
    for (rank, addr) in addrs.enumerate() {
        let shaped = addr
            .rsplit_once(':')
            .is_some_and(|(host, port)| is_host(host) && port.parse::<u16>().is_ok());
        if !shaped {
            return Err(bad_file(format!(
                "{what}: rank {rank}'s address '{}' is not host:port (a host name of 1 to 255 \
                 characters that is not all digits and dots, an IPv4 address or a bracketed \
                 IPv6 one)",
                addr.escape_debug()
            )));
        }
        if addr.ends_with(":0") {
            continue;
        }
        if let Some(first) = seen.insert(addr, rank) {
            return Err(bad_file(format!(
                "{what}: ranks {first} and {rank} are both at {addr}: every rank needs its own address"
            )));
        }
    }
    Ok(())
}

impl ClusterFile {
    /// Generates a cluster of `addrs.len()` workers (a fresh CA, one certificate and key per
    /// rank) for run `run_id` (its low 63 bits: TOML integers are signed) and writes it to
    /// `dir`: `ca.pem`, `rank-K.pem`, `rank-K.key` (owner-only) and `cluster.toml`. Every
    /// input is checked before anything is written; the files are written into a temporary
    /// directory beside `dir` that is renamed into place, so `dir` holds either its old
    /// contents or the whole new cluster. An existing, non-empty `dir` is refused or
    /// replaced whole, as `existing` says.
    ///
    /// # Errors
    /// [`TransportError::BadFile`]: no workers or too many, two ranks at one address, an
    /// existing cluster to refuse; [`TransportError::Setup`]: unwritable files.
    pub fn init(
        dir: &Path,
        addrs: &[String],
        run_id: u64,
        existing: Existing,
    ) -> Result<Self, TransportError> {
        let n = u32::try_from(addrs.len()).unwrap_or(u32::MAX);
        if n == 0 || n > MAX_WORKERS {
            return Err(bad_file(format!(
                "a cluster of {n} workers (1 to {MAX_WORKERS})"
            )));
        }
        // Typed once here: the addresses are checked, written and later connected to as
        // trimmed (a space kept in the file never resolves, and " h" and "h" are one host).
        let addrs: Vec<String> = addrs.iter().map(|a| a.trim().to_owned()).collect();
        check_addrs(addrs.iter().map(String::as_str), "the addresses")?;
        let addrs = addrs.as_slice();
        let given = dir;
        // A link to a directory stands for it: the cluster replaces the directory it names,
        // and the link stays (renaming over the link would replace it with a folder).
        let resolved;
        let dir = if std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
            resolved = std::fs::canonicalize(dir).map_err(|e| {
                bad_file(format!(
                    "{}: a symbolic link that names nothing usable: {e}",
                    dir.display()
                ))
            })?;
            resolved.as_path()
        } else {
            dir
        };
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            return Err(bad_file(format!(
                "{} is not a directory: give a new directory for the cluster",
                dir.display()
            )));
        }
        let occupied = std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some());
        if occupied && existing == Existing::Refuse {
            return Err(bad_file(format!(
                "{} is not empty (a cluster's credentials may be deployed from it): give a new \
                 directory, or --force to replace it whole",
                dir.display()
            )));
        }
        if occupied {
            refuse_foreign_entries(dir)?;
        }
        let staging = sibling(dir, "tmp")?;
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging)
            .map_err(|e| setup(format!("{}: {e}", staging.display())))?;
        // The directory put in `dir`'s place keeps its permissions (a launcher's private one
        // stays closed to others).
        if let Ok(meta) = std::fs::metadata(dir) {
            std::fs::set_permissions(&staging, meta.permissions())
                .map_err(|e| setup(format!("{}: {e}", staging.display())))?;
        }
        let written = Self::write_new(&staging, addrs, run_id);
        let placed = written.and_then(|file| {
            replace_dir(&staging, dir)?;
            Ok(ClusterFile {
                dir: given.to_path_buf(),
                ..file
            })
        });
        if placed.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        placed
    }

    /// Writes a new cluster for `addrs` into the empty directory `dir`.
    fn write_new(dir: &Path, addrs: &[String], run_id: u64) -> Result<Self, TransportError> {
        let cluster = Cluster::generate(addrs.len() as u32)?;
        write_file(&dir.join("ca.pem"), cluster.ca_pem.as_bytes(), false)?;
        let mut workers = Vec::with_capacity(addrs.len());
        for (rank, ((cert, key, _), addr)) in cluster.ranks.iter().zip(addrs).enumerate() {
            let (cert_name, key_name) = (format!("rank-{rank}.pem"), format!("rank-{rank}.key"));
            write_file(&dir.join(&cert_name), cert.as_bytes(), false)?;
            write_file(&dir.join(&key_name), key.as_bytes(), true)?;
            workers.push(WorkerEntry {
                addr: addr.clone(),
                cert: cert_name.into(),
                key: key_name.into(),
            });
        }
        let file = ClusterFile {
            run_id: run_id & (i64::MAX as u64),
            ca: "ca.pem".into(),
            workers,
            dir: dir.to_path_buf(),
        };
        let text = toml::to_string(&file).map_err(|e| setup(format!("cluster.toml: {e}")))?;
        let header =
            "# A pipe cluster: `pipe worker --cluster cluster.toml --rank K` on each host.\n";
        write_file(
            &dir.join("cluster.toml"),
            format!("{header}{text}").as_bytes(),
            false,
        )?;
        Ok(file)
    }

    /// Reads and checks `cluster.toml`.
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming the file: unreadable, oversized, malformed, unknown
    /// keys, no workers or too many.
    pub fn load(path: &Path) -> Result<Self, TransportError> {
        let bytes = read_bounded(path)?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|e| bad_file(format!("{}: not UTF-8: {e}", path.display())))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::parse(text, &path.display().to_string(), dir)
    }

    /// Parses and checks the text of a cluster file, `name` in errors, whose paths are
    /// relative to `dir`: what [`ClusterFile::load`] does once the file is read.
    ///
    /// # Errors
    /// As [`ClusterFile::load`], the file read.
    pub fn parse(text: &str, name: &str, dir: &Path) -> Result<Self, TransportError> {
        let mut file: ClusterFile = toml::from_str(text).map_err(|e| {
            let one_line = e
                .to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            bad_file(format!("{name}: {one_line}"))
        })?;
        let n = file.workers.len();
        if n == 0 || n > MAX_WORKERS as usize {
            return Err(bad_file(format!(
                "{name}: {n} workers (1 to {MAX_WORKERS})"
            )));
        }
        for worker in &mut file.workers {
            worker.addr = worker.addr.trim().to_owned();
        }
        check_addrs(file.workers.iter().map(|w| w.addr.as_str()), name)?;
        file.dir = dir.to_path_buf();
        Ok(file)
    }

    /// Number of workers.
    pub fn size(&self) -> u32 {
        self.workers.len() as u32
    }

    /// Every rank's address, resolved.
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming an address that does not resolve.
    pub fn addrs(&self) -> Result<Vec<SocketAddr>, TransportError> {
        self.workers
            .iter()
            .enumerate()
            .map(|(rank, w)| {
                w.addr
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.next())
                    .ok_or_else(|| {
                        bad_file(format!(
                            "rank {rank}: address '{}' does not resolve",
                            w.addr
                        ))
                    })
            })
            .collect::<Result<Vec<SocketAddr>, TransportError>>()
            .and_then(|addrs| {
                let mut seen = std::collections::HashMap::with_capacity(addrs.len());
                for (rank, a) in addrs.iter().enumerate() {
                    if a.port() == 0 {
                        continue;
                    }
                    if let Some(first) = seen.insert(*a, rank) {
                        return Err(bad_file(format!(
                            "ranks {first} and {rank} both resolve to {a}: every rank needs its \
                             own address"
                        )));
                    }
                }
                Ok(addrs)
            })
    }

    /// Rank `rank`'s credentials, read from disk.
    ///
    /// # Errors
    /// [`TransportError::Setup`] naming the file: no such rank, unreadable or malformed PEM.
    pub fn credentials(&self, rank: u32) -> Result<Credentials, TransportError> {
        let w = self.workers.get(rank as usize).ok_or_else(|| {
            setup(format!(
                "rank {rank} in a cluster of {}",
                self.workers.len()
            ))
        })?;
        let pem = |p: &Path| -> Result<(PathBuf, Vec<u8>), TransportError> {
            let path = self.dir.join(p);
            let bytes = read_bounded(&path)?;
            Ok((path, bytes))
        };
        let (path, bytes) = pem(&self.ca)?;
        let ca = CertificateDer::from_pem_slice(&bytes)
            .map_err(|e| bad_file(format!("{}: {e}", path.display())))?;
        let (path, bytes) = pem(&w.cert)?;
        let cert = CertificateDer::from_pem_slice(&bytes)
            .map_err(|e| bad_file(format!("{}: {e}", path.display())))?;
        let (path, bytes) = pem(&w.key)?;
        let key = PrivateKeyDer::from_pem_slice(&bytes)
            .map_err(|e| bad_file(format!("{}: {e}", path.display())))?;
        Ok(Credentials {
            ca,
            chain: vec![cert],
            key,
        })
    }
}

/// Environment variables that carry a worker's rank, in the order they are read: pipe's own,
/// torchrun's (one per process), Slurm's (one per task), a Kubernetes indexed Job's. The first
/// that is set wins: under torchrun inside a Slurm allocation, `SLURM_PROCID` numbers the
/// node's task while `RANK` numbers the process, and the process is what a worker is.
pub const RANK_VARIABLES: [&str; 4] = ["PIPE_RANK", "RANK", "SLURM_PROCID", "JOB_COMPLETION_INDEX"];

/// This worker's rank: `explicit` (`--rank`) if given, else the first of [`RANK_VARIABLES`]
/// that `lookup` finds. It must parse and be below `size`.
///
/// # Errors
/// A one-line description: no source, an unparsable value, a rank outside the cluster.
pub fn resolve_rank(
    explicit: Option<u32>,
    lookup: impl Fn(&str) -> Option<String>,
    size: u32,
) -> Result<u32, String> {
    let (source, rank) = match explicit {
        Some(r) => ("--rank".to_string(), r),
        None => {
            let Some((var, value)) = RANK_VARIABLES
                .iter()
                .find_map(|v| lookup(v).map(|value| (*v, value)))
            else {
                return Err(format!(
                    "no rank: pass --rank or set one of {}",
                    RANK_VARIABLES.join(", ")
                ));
            };
            let r = value
                .trim()
                .parse::<u32>()
                .map_err(|_| format!("{var}={value:?} is not a rank"))?;
            (var.to_string(), r)
        }
    };
    if rank >= size {
        return Err(format!(
            "rank {rank} (from {source}) in a cluster of {size} workers"
        ));
    }
    Ok(rank)
}

/// The DNS name on rank `rank`'s certificate, which a dialling peer verifies.
pub fn server_name(rank: u32) -> String {
    format!("rank-{rank}.pipe")
}

/// `what` failed, as a setup error.
fn setup_err(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("{what}: {e}"))
}

/// A worker's TLS identity: the cluster CA it trusts and its own certificate and key.
#[derive(Debug)]
pub struct Credentials {
    /// The cluster CA certificate (DER).
    pub ca: CertificateDer<'static>,
    /// This worker's certificate chain (DER), leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// This worker's private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Credentials {
    fn clone(&self) -> Self {
        Credentials {
            ca: self.ca.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
        }
    }
}

/// A cluster CA and one certificate per rank, as `pipe cluster init` writes them and local
/// launches make for themselves.
#[derive(Debug)]
pub struct Cluster {
    /// The CA certificate in PEM.
    pub ca_pem: String,
    /// Per rank: certificate PEM, key PEM, and the same as [`Credentials`].
    pub ranks: Vec<(String, String, Credentials)>,
}

impl Cluster {
    /// A fresh CA (its key is discarded: nobody can add a rank later) and `workers`
    /// certificates, each valid for [`server_name`] of its rank, for client and server use.
    ///
    /// # Errors
    /// [`TransportError::Setup`] when certificate generation fails.
    pub fn generate(workers: u32) -> Result<Self, TransportError> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
            KeyPair, KeyUsagePurpose,
        };
        let err = |e: rcgen::Error| setup_err("certificate generation", e);
        let ca_key = KeyPair::generate().map_err(err)?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "pipe cluster CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_cert = ca_params.self_signed(&ca_key).map_err(err)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let ranks = (0..workers)
            .map(|rank| {
                let key = KeyPair::generate().map_err(err)?;
                let mut params = CertificateParams::new(vec![server_name(rank)]).map_err(err)?;
                params
                    .distinguished_name
                    .push(DnType::CommonName, format!("pipe rank {rank}"));
                params.extended_key_usages = vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ];
                let cert = params.signed_by(&key, &issuer).map_err(err)?;
                let creds = Credentials {
                    ca: ca_cert.der().clone(),
                    chain: vec![cert.der().clone()],
                    key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
                };
                Ok((cert.pem(), key.serialize_pem(), creds))
            })
            .collect::<Result<Vec<_>, TransportError>>()?;
        Ok(Cluster {
            ca_pem: ca_cert.pem(),
            ranks,
        })
    }
}
