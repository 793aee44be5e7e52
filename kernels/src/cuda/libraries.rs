//! Finding CUDA's shared libraries on any installation: a full toolkit, a driver plus the
//! `nvidia-*` Python wheels (versioned names only), or a framework's bundled copies, CUDA 12 or
//! 13, without links or variables set by hand.
//!
//! The bindings (cudarc with dynamic loading) open each library by a fixed list of names, the
//! unversioned `libcublas.so` first and CUDA 12's `.so.12` later, through the dynamic loader's
//! search path. That finds a toolkit's stub `libcuda.so` before the driver's `libcuda.so.1`
//! whenever `lib64/stubs` is on the path (every CUDA call then fails), and never finds CUDA 13's
//! `libcublas.so.13`. So the search is done here, in plain Rust over the file system: every
//! place a library may be is listed ([`SearchPath`]), stubs are skipped, versions are read from
//! the files' names, and one consistent set is chosen ([`resolve`]). The binary then gives the
//! bindings a private folder of links under the names they try first, ahead of everything on
//! the loader's path ([`Resolution::library_path`]). Nothing here loads a library, so it runs
//! and is tested on machines without CUDA.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The environment variable that holds the private link folder once it is in place (so a
/// process started with it, and every worker it spawns, searches no further).
pub const LINKS_VARIABLE: &str = "PIPE_CUDA_LIBRARIES";

/// A library the CUDA backend and NCCL open.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Library {
    /// The driver API (`libcuda.so.1`), installed with the NVIDIA driver.
    Driver,
    /// cuBLAS.
    Cublas,
    /// cuBLASLt, which cuBLAS itself loads.
    CublasLt,
    /// The run-time compiler of the kernels.
    Nvrtc,
    /// NCCL (replicas on separate GPUs; optional).
    Nccl,
}

impl Library {
    /// Every library, in the order they are reported.
    pub const ALL: [Library; 5] = [
        Library::Driver,
        Library::Cublas,
        Library::CublasLt,
        Library::Nvrtc,
        Library::Nccl,
    ];

    /// The file name's stem: `lib<stem>.so...`.
    pub fn stem(self) -> &'static str {
        match self {
            Library::Driver => "cuda",
            Library::Cublas => "cublas",
            Library::CublasLt => "cublasLt",
            Library::Nvrtc => "nvrtc",
            Library::Nccl => "nccl",
        }
    }

    /// The unversioned name the bindings try first, under which the link folder offers it.
    pub fn link_name(self) -> String {
        format!("lib{}.so", self.stem())
    }

    /// Whether the backend can run without it (NCCL: the replicas' ring through the host).
    pub fn optional(self) -> bool {
        self == Library::Nccl
    }

    /// Whether its version follows the CUDA release (12.x, 13.x), which must agree among
    /// cuBLAS, cuBLASLt and NVRTC and suit the driver.
    fn follows_cuda(self) -> bool {
        matches!(self, Library::Cublas | Library::CublasLt | Library::Nvrtc)
    }
}

impl std::fmt::Display for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Library::Driver => "driver",
            Library::Cublas => "cuBLAS",
            Library::CublasLt => "cuBLASLt",
            Library::Nvrtc => "NVRTC",
            Library::Nccl => "NCCL",
        })
    }
}

/// The CUDA major versions the bindings run with, and the oldest driver branch of each
/// (NVIDIA's minimum driver for CUDA 12.x and 13.x on Linux).
const CUDA_MAJORS: [(u32, u32); 2] = [(13, 580), (12, 525)];

/// The folders searched, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SearchPath {
    /// Folders, first searched first, without repeats.
    pub dirs: Vec<PathBuf>,
}

/// Reads one environment variable.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<OsString>;

impl SearchPath {
    /// Where libraries may be on this machine: `LD_LIBRARY_PATH`, `CUDA_HOME` and `CUDA_PATH`,
    /// the toolkits under `/usr/local/cuda*` (newest first), the driver's folders, the
    /// system's, and the `nvidia-*` wheels of the Python environments (`VIRTUAL_ENV`,
    /// `CONDA_PREFIX`, the system's and the user's site-packages).
    pub fn from_environment() -> Self {
        Self::discover(&|name| std::env::var_os(name), Path::new("/"))
    }

    /// [`SearchPath::from_environment`] with the environment read through `env` and every
    /// well-known absolute folder taken under `root` (`/` in use; a fake tree in tests).
    pub fn discover(env: Env<'_>, root: &Path) -> Self {
        let under = |p: &str| root.join(p.trim_start_matches('/'));
        let mut dirs = Vec::new();
        if let Some(paths) = env("LD_LIBRARY_PATH") {
            dirs.extend(std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty()));
        }
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Some(home) = env(var) {
                dirs.extend(toolkit_dirs(Path::new(&home)));
            }
        }
        dirs.extend(toolkit_dirs(&under("/usr/local/cuda")));
        let mut versioned = matching_children(&under("/usr/local"), |n| n.starts_with("cuda-"));
        versioned.sort_by(|a, b| b.cmp(a));
        for t in versioned {
            dirs.extend(toolkit_dirs(&t));
        }
        for d in [
            "/usr/local/nvidia/lib64",
            "/usr/local/nvidia/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/lib/x86_64-linux-gnu",
            "/usr/lib/wsl/lib",
        ] {
            dirs.push(under(d));
        }
        for prefix in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
            if let Some(p) = env(prefix) {
                let p = PathBuf::from(p);
                dirs.push(p.join("lib"));
                dirs.extend(wheel_dirs(&p.join("lib")));
            }
        }
        for lib in ["/usr/local/lib", "/usr/lib"] {
            dirs.extend(wheel_dirs(&under(lib)));
        }
        if let Some(home) = env("HOME") {
            dirs.extend(wheel_dirs(&PathBuf::from(home).join(".local/lib")));
        }
        Self::new(dirs)
    }

    /// Those of these folders that exist, in order, repeats dropped.
    pub fn new(dirs: impl IntoIterator<Item = PathBuf>) -> Self {
        let mut seen = HashSet::new();
        Self {
            dirs: dirs
                .into_iter()
                .filter(|d| d.is_dir() && seen.insert(d.clone()))
                .collect(),
        }
    }
}

/// A toolkit's library folders.
fn toolkit_dirs(home: &Path) -> Vec<PathBuf> {
    vec![
        home.join("lib64"),
        home.join("targets/x86_64-linux/lib"),
        home.join("targets/sbsa-linux/lib"),
        home.join("lib"),
    ]
}

/// The `nvidia/*/lib` folders (and CUDA 13's `nvidia/cu13/lib`) of every `python3*`
/// environment's site-packages and dist-packages under `lib`.
fn wheel_dirs(lib: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pythons = matching_children(lib, |n| n.starts_with("python3"));
    pythons.sort();
    for py in pythons {
        for packages in ["site-packages", "dist-packages"] {
            let nvidia = py.join(packages).join("nvidia");
            let mut wheels = matching_children(&nvidia, |_| true);
            wheels.sort();
            out.extend(wheels.into_iter().map(|w| w.join("lib")));
            // Bundled copies (a framework's own lib folder, e.g. torch/lib).
            out.push(py.join(packages).join("torch/lib"));
        }
    }
    out
}

/// The entries of `dir` whose names pass `keep` (none when it cannot be read).
fn matching_children(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_str().is_some_and(&keep))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// One file that is a library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// Which library.
    pub library: Library,
    /// The file as found (perhaps a link).
    pub path: PathBuf,
    /// The file it names once links are followed.
    pub target: PathBuf,
    /// The version its (resolved) name carries, `13.1.0.3` or the driver's `580.159.04`.
    pub version: Option<String>,
}

impl Found {
    /// The first number of the version (the CUDA major, or the driver's branch).
    pub fn major(&self) -> Option<u32> {
        self.version
            .as_deref()
            .and_then(|v| v.split('.').next())
            .and_then(|m| m.parse().ok())
    }
}

/// Whether `path` lies in a `stubs` folder (a toolkit's link-time stand-ins, which fail at run
/// time).
fn is_stub(path: &Path) -> bool {
    path.components()
        .any(|c| c.as_os_str() == OsStr::new("stubs"))
}

/// The version in a library's file name: what follows `lib<stem>.so.`.
fn version_of(name: &str, stem: &str) -> Option<String> {
    let rest = name.strip_prefix(&format!("lib{stem}.so."))?;
    let ok = !rest.is_empty()
        && rest
            .split('.')
            .all(|p| p.chars().all(|c| c.is_ascii_digit()));
    ok.then(|| rest.to_string())
}

/// Whether `path` is a regular file that starts as an ELF object does: a directory, a FIFO
/// (which a read would wait on), an empty or truncated file or a text file by a library's name
/// is not one the loader could open, and choosing it would put a working copy behind it.
fn is_elf_file(path: &Path) -> bool {
    use std::io::Read;
    let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    let mut magic = [0u8; 4];
    regular
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && magic == *b"\x7fELF"
}

/// Every copy of `library` in `dir`: stubs left out (counted in `skipped.0`), and files that
/// are no ELF object (counted in `skipped.1`).
fn scan(dir: &Path, library: Library, skipped: &mut (Vec<PathBuf>, Vec<PathBuf>)) -> Vec<Found> {
    let stem = library.stem();
    let bare = format!("lib{stem}.so");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| *n == bare || version_of(n, stem).is_some())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let path = dir.join(&name);
        let Ok(target) = std::fs::canonicalize(&path) else {
            continue; // a dangling link
        };
        if is_stub(&path) || is_stub(&target) {
            skipped.0.push(path);
            continue;
        }
        if !is_elf_file(&target) {
            skipped.1.push(path);
            continue;
        }
        let target_name = target.file_name().and_then(OsStr::to_str).unwrap_or("");
        let version = version_of(target_name, stem).or_else(|| version_of(&name, stem));
        out.push(Found {
            library,
            path,
            target,
            version,
        });
    }
    out
}

/// What the search found: one file per library it could find, and for those it could not,
/// where it looked.
#[derive(Clone, Debug, Default)]
pub struct Resolution {
    /// The chosen file of each library found, in [`Library::ALL`] order.
    pub chosen: Vec<Found>,
    /// Libraries not found (or found only in versions that cannot run here), with why.
    pub missing: Vec<(Library, String)>,
    /// Stub files passed over.
    pub stubs: Vec<PathBuf>,
    /// Files by a library's name that are no ELF object (a directory, a FIFO, a text or
    /// truncated file), passed over.
    pub not_libraries: Vec<PathBuf>,
    /// The folders searched.
    pub searched: Vec<PathBuf>,
}

/// Chooses one file per library from `search`: the driver from its first folder holding a
/// real one; cuBLAS, cuBLASLt and NVRTC of the newest CUDA major (13, then 12) that all three
/// share and the driver runs (13 needs driver 580 or newer, 12 needs 525); NCCL's first.
/// Within a choice, folders earlier in the search win, and a file whose name carries its
/// version over a bare `lib*.so` of unknown version.
pub fn resolve(search: &SearchPath) -> Resolution {
    let mut skipped = (Vec::new(), Vec::new());
    let mut all: Vec<Found> = Vec::new();
    for dir in &search.dirs {
        for library in Library::ALL {
            all.extend(scan(dir, library, &mut skipped));
        }
    }
    let (stubs, not_libraries) = skipped;
    let first = |library: Library, major: Option<u32>| -> Option<Found> {
        let of = |f: &&Found| f.library == library && (major.is_none() || f.major() == major);
        // Versioned first, then whatever came first in the search.
        all.iter()
            .filter(of)
            .find(|f| f.version.is_some())
            .or_else(|| all.iter().find(of))
            .cloned()
    };
    let mut res = Resolution {
        stubs,
        not_libraries,
        searched: search.dirs.clone(),
        ..Resolution::default()
    };
    let driver = first(Library::Driver, None);
    let driver_branch = driver.as_ref().and_then(Found::major);
    let cuda_major = CUDA_MAJORS
        .iter()
        .find(|&&(major, oldest_driver)| {
            driver_branch.is_none_or(|b| b >= oldest_driver)
                && [Library::Cublas, Library::CublasLt, Library::Nvrtc]
                    .iter()
                    .all(|&l| first(l, Some(major)).is_some())
        })
        .map(|&(major, _)| major);
    for library in Library::ALL {
        let found = if library.follows_cuda() {
            // Without a usable major, a bare `lib*.so` of unknown version is a last resort.
            cuda_major
                .and_then(|m| first(library, Some(m)))
                .or_else(|| {
                    all.iter()
                        .find(|f| f.library == library && f.version.is_none())
                        .cloned()
                })
        } else {
            first(library, None)
        };
        match found {
            Some(f) => res.chosen.push(f),
            None => {
                let why = why_missing(library, &all, driver_branch);
                res.missing.push((library, why));
            }
        }
    }
    res
}

/// Why `library` was not chosen.
fn why_missing(library: Library, all: &[Found], driver_branch: Option<u32>) -> String {
    let versions: Vec<String> = all
        .iter()
        .filter(|f| f.library == library)
        .map(|f| {
            format!(
                "{} ({})",
                f.path.display(),
                f.version.as_deref().unwrap_or("?")
            )
        })
        .collect();
    if versions.is_empty() {
        return format!("no lib{}.so* in the folders searched", library.stem());
    }
    let driver = driver_branch.map_or_else(|| "?".to_string(), |b| b.to_string());
    format!(
        "found only {} (cuBLAS, cuBLASLt and NVRTC must share a CUDA major of 12 or 13 that \
         driver {driver} runs: 13 needs 580+, 12 needs 525+)",
        versions.join(", ")
    )
}

impl Resolution {
    /// The chosen file of `library`.
    pub fn get(&self, library: Library) -> Option<&Found> {
        self.chosen.iter().find(|f| f.library == library)
    }

    /// Whether every library the backend needs was found.
    pub fn complete(&self) -> bool {
        self.missing.iter().all(|(l, _)| l.optional())
    }

    /// What was chosen for `library`, or why nothing was.
    fn status(&self, library: Library) -> String {
        if let Some(f) = self.get(library) {
            return format!("{library}: {}", describe(f));
        }
        let why = self
            .missing
            .iter()
            .find(|(l, _)| *l == library)
            .map_or("not searched", |(_, w)| w.as_str());
        format!("{library} not found: {why}")
    }

    /// Where the search looked and the stubs it passed over.
    fn places(&self) -> String {
        let mut line = format!("searched {}", join_paths(&self.searched));
        if self.searched.is_empty() {
            line = "searched no existing folder".into();
        }
        if !self.stubs.is_empty() {
            let _ = write!(line, "; skipped stubs {}", join_paths(&self.stubs));
        }
        if !self.not_libraries.is_empty() {
            let _ = write!(
                line,
                "; skipped files that are no ELF library {}",
                join_paths(&self.not_libraries)
            );
        }
        line
    }

    /// One line for an error about `library`: what was chosen, or why nothing fit and where
    /// the search looked.
    pub fn explain(&self, library: Library) -> String {
        match self.get(library) {
            Some(_) => self.status(library),
            None => format!("{}; {}", self.status(library), self.places()),
        }
    }

    /// The links the private folder holds: each library's unversioned name (the one the
    /// bindings try first) and its own file name, to the chosen file.
    pub fn links(&self) -> Vec<(String, PathBuf)> {
        let mut out = Vec::new();
        for f in &self.chosen {
            out.push((f.library.link_name(), f.target.clone()));
            if let Some(name) = f.path.file_name().and_then(OsStr::to_str)
                && name != f.library.link_name()
            {
                out.push((name.to_string(), f.target.clone()));
            }
        }
        out
    }

    /// The loader's search path for a process that should open the chosen files: the link
    /// folder, the chosen files' own folders (for what they load themselves, such as NVRTC's
    /// builtins), then `previous` without its stub folders.
    pub fn library_path(&self, link_dir: &Path, previous: Option<&OsStr>) -> OsString {
        let mut dirs = vec![link_dir.to_path_buf()];
        for f in &self.chosen {
            if let Some(d) = f.target.parent() {
                dirs.push(d.to_path_buf());
            }
        }
        if let Some(p) = previous {
            dirs.extend(std::env::split_paths(p).filter(|d| !d.as_os_str().is_empty()));
        }
        let mut seen = HashSet::new();
        let dirs: Vec<PathBuf> = dirs
            .into_iter()
            .filter(|d| !is_stub(d) && seen.insert(d.clone()))
            .collect();
        std::env::join_paths(dirs).unwrap_or_default()
    }

    /// A report of the whole search: one line per library, then where it looked.
    pub fn report(&self) -> String {
        let mut out = String::new();
        for library in Library::ALL {
            let _ = writeln!(out, "{}", self.status(library));
        }
        let _ = writeln!(out, "{}", self.places());
        out
    }
}

fn describe(f: &Found) -> String {
    let version = f.version.as_deref().unwrap_or("version unknown");
    if f.path == f.target {
        format!("{} ({version})", f.path.display())
    } else {
        format!("{} -> {} ({version})", f.path.display(), f.target.display())
    }
}

fn join_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where the link folder goes: this user's runtime folder (`XDG_RUNTIME_DIR`) where there is
/// one, the system's temporary folder otherwise ([`link_folder`] checks what it finds there).
pub fn link_base() -> PathBuf {
    std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir)
}

/// What the search of this machine finds or tries for `library`, on one line (for an error
/// that says a library could not be opened).
pub fn explain(library: Library) -> String {
    resolve(&SearchPath::from_environment()).explain(library)
}

/// Makes (or reuses) the private link folder for `res` under `base` and returns it: one folder
/// per set of chosen files, named by a hash of their paths, filled under a temporary name and
/// renamed into place so concurrent processes never see it half made.
///
/// Everything in that folder is loaded ahead of the system's libraries, so a folder found in
/// place is used only if it is exactly what this process would make: owned by this user,
/// writable by no one else, and holding the expected links and nothing more. Otherwise (a
/// shared `base` where someone else made the name first) a folder of this process's own is
/// made beside it.
///
/// # Errors
/// File-system failures.
#[cfg(unix)]
pub fn link_folder(res: &Resolution, base: &Path) -> std::io::Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    let links = res.links();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    links.hash(&mut h);
    let name = format!("pipe-cuda-libraries-{:016x}", h.finish());
    let dir = base.join(&name);
    let tmp = base.join(format!("{name}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    // Writable by this user alone, whatever the umask.
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    for (link, target) in &links {
        std::os::unix::fs::symlink(target, tmp.join(link))?;
    }
    if dir.is_dir() && is_exactly(&dir, &links, &tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Ok(dir);
    }
    if dir.exists() {
        // Not ours, or not as expected: keep this process's own folder.
        return Ok(tmp);
    }
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process put a folder there first: use it if it is exactly ours.
        Err(_) if is_exactly(&dir, &links, &tmp) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(_) => Ok(tmp),
    }
}

/// Whether `dir` holds exactly `links` (each a link to its target, nothing else), belongs to
/// the owner of `mine` (a folder this process just made) and is writable by its owner alone.
#[cfg(unix)]
fn is_exactly(dir: &Path, links: &[(String, PathBuf)], mine: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(meta), Ok(own)) = (std::fs::symlink_metadata(dir), std::fs::metadata(mine)) else {
        return false;
    };
    if !meta.is_dir() || meta.uid() != own.uid() || meta.mode() & 0o022 != 0 {
        return false;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let names: HashSet<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.len() == links.len()
        && links.iter().all(|(name, target)| {
            names.contains(name) && std::fs::read_link(dir.join(name)).is_ok_and(|t| t == *target)
        })
}
