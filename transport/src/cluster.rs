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

/// A file's bytes, refusing anything over [`MAX_FILE_BYTES`].
fn read_bounded(path: &Path) -> Result<Vec<u8>, TransportError> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(|e| setup(format!("{}: {e}", path.display())))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| setup(format!("{}: {e}", path.display())))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(setup(format!(
            "{}: more than the {MAX_FILE_BYTES} bytes a cluster file may have",
            path.display()
        )));
    }
    Ok(bytes)
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

impl ClusterFile {
    /// Generates a cluster of `addrs.len()` workers (a fresh CA, one certificate and key per
    /// rank) for run `run_id` (its low 63 bits: TOML integers are signed) and writes it to
    /// `dir`: `ca.pem`, `rank-K.pem`, `rank-K.key`
    /// (owner-only) and `cluster.toml`.
    ///
    /// # Errors
    /// [`TransportError::Setup`]: no workers or too many, unwritable files.
    pub fn init(dir: &Path, addrs: &[String], run_id: u64) -> Result<Self, TransportError> {
        let n = u32::try_from(addrs.len()).unwrap_or(u32::MAX);
        if n == 0 || n > MAX_WORKERS {
            return Err(setup(format!(
                "a cluster of {n} workers (1 to {MAX_WORKERS})"
            )));
        }
        std::fs::create_dir_all(dir).map_err(|e| setup(format!("{}: {e}", dir.display())))?;
        let cluster = Cluster::generate(n)?;
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
            .map_err(|e| setup(format!("{}: not UTF-8: {e}", path.display())))?;
        let mut file: ClusterFile = toml::from_str(text).map_err(|e| {
            let one_line = e
                .to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            setup(format!("{}: {one_line}", path.display()))
        })?;
        let n = file.workers.len();
        if n == 0 || n > MAX_WORKERS as usize {
            return Err(setup(format!(
                "{}: {n} workers (1 to {MAX_WORKERS})",
                path.display()
            )));
        }
        file.dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
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
                        setup(format!(
                            "rank {rank}: address '{}' does not resolve",
                            w.addr
                        ))
                    })
            })
            .collect()
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
            .map_err(|e| setup(format!("{}: {e}", path.display())))?;
        let (path, bytes) = pem(&w.cert)?;
        let cert = CertificateDer::from_pem_slice(&bytes)
            .map_err(|e| setup(format!("{}: {e}", path.display())))?;
        let (path, bytes) = pem(&w.key)?;
        let key = PrivateKeyDer::from_pem_slice(&bytes)
            .map_err(|e| setup(format!("{}: {e}", path.display())))?;
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
