//! The CUDA library search against fake installations (empty files and links laid out as a
//! toolkit, a driver and the Python wheels lay them out), so it is checked without a GPU: stubs
//! are never chosen, CUDA 13's versioned-only names are found, 12 and 13 side by side give one
//! consistent set the driver can run, and a missing library is reported with where it was
//! looked for.

#![allow(clippy::unwrap_used)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use pipe_kernels::cuda::libraries::{Library, SearchPath, link_folder, resolve};

#[path = "../../tests/common/scratch.rs"]
mod scratch;

/// A fresh folder under the system's temporary folder, removed on drop.
struct Tree(PathBuf);

impl Tree {
    fn new(name: &str) -> Self {
        // Named apart from the folders a search treats by name (`stubs`).
        Tree(scratch::fresh_dir(&format!("tree-{name}")))
    }

    /// A file at `rel` (its folders made) holding only an ELF header's first bytes: a
    /// library as far as the search reads one.
    fn file(&self, rel: &str) -> &Self {
        self.bytes(rel, b"\x7fELF\x02\x01\x01")
    }

    /// A file at `rel` holding `bytes`.
    fn bytes(&self, rel: &str, bytes: &[u8]) -> &Self {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, bytes).unwrap();
        self
    }

    /// A link at `rel` to `target` (relative to the link's folder, as installers make them).
    fn link(&self, rel: &str, target: &str) -> &Self {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(target, &p).unwrap();
        self
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }

    /// The search as `pipe` makes it, with this tree as `/` and `vars` as the environment.
    fn search(&self, vars: &[(&str, PathBuf)]) -> SearchPath {
        let vars: Vec<(String, OsString)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone().into_os_string()))
            .collect();
        let env = move |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        SearchPath::discover(&env, &self.0)
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The driver as the NVIDIA container runtime mounts it.
fn driver(t: &Tree, version: &str) {
    t.file(&format!("usr/local/nvidia/lib64/libcuda.so.{version}"))
        .link(
            "usr/local/nvidia/lib64/libcuda.so.1",
            &format!("libcuda.so.{version}"),
        );
}

/// A CUDA toolkit at `home`: versioned libraries, development links, and a stubs folder with
/// its own libcuda.so, libcublas.so and libnvrtc.so.
fn toolkit(t: &Tree, home: &str, major: u32, full: &str) {
    let lib = format!("{home}/targets/x86_64-linux/lib");
    for stem in ["cublas", "cublasLt", "nvrtc"] {
        t.file(&format!("{lib}/lib{stem}.so.{full}"))
            .link(
                &format!("{lib}/lib{stem}.so.{major}"),
                &format!("lib{stem}.so.{full}"),
            )
            .link(
                &format!("{lib}/lib{stem}.so"),
                &format!("lib{stem}.so.{major}"),
            );
    }
    for stem in ["cuda", "cublas", "nvrtc"] {
        t.file(&format!("{lib}/stubs/lib{stem}.so"));
    }
    t.link(&format!("{home}/lib64"), "targets/x86_64-linux/lib");
}

fn chosen(res: &pipe_kernels::cuda::libraries::Resolution, l: Library) -> (PathBuf, String) {
    let f = res
        .get(l)
        .unwrap_or_else(|| panic!("{l} not chosen: {}", res.report()));
    (f.target.clone(), f.version.clone().unwrap_or_default())
}

#[test]
fn a_toolkit_with_its_stubs_first_on_the_path_gives_the_real_driver() {
    let t = Tree::new("stubs");
    driver(&t, "580.159.04");
    toolkit(&t, "usr/local/cuda-13.0", 13, "13.1.0.3");
    t.link("usr/local/cuda", "cuda-13.0");
    let stubs = t.path("usr/local/cuda/lib64/stubs");
    let res = resolve(&t.search(&[("LD_LIBRARY_PATH", stubs)]));
    assert!(res.complete(), "{}", res.report());
    let (driver, version) = chosen(&res, Library::Driver);
    assert_eq!(version, "580.159.04");
    assert!(driver.starts_with(t.path("usr/local/nvidia")), "{driver:?}");
    for l in [Library::Cublas, Library::CublasLt, Library::Nvrtc] {
        let (path, version) = chosen(&res, l);
        assert_eq!(version, "13.1.0.3", "{l}");
        assert!(
            !path.components().any(|c| c.as_os_str() == "stubs"),
            "{path:?}"
        );
    }
    assert!(
        res.stubs.len() >= 3,
        "the stubs were seen and passed over: {:?}",
        res.stubs
    );
    assert!(res.get(Library::Nccl).is_none() && !res.explain(Library::Nccl).is_empty());
}

#[test]
fn the_driver_and_cuda_13_wheels_alone_are_found_by_their_versioned_names() {
    let t = Tree::new("wheels");
    driver(&t, "580.65.06");
    let site = "venv/lib/python3.12/site-packages/nvidia";
    t.file(&format!("{site}/cu13/lib/libcublas.so.13"))
        .file(&format!("{site}/cu13/lib/libcublasLt.so.13"))
        .file(&format!("{site}/cu13/lib/libnvrtc.so.13"))
        .file(&format!("{site}/cu13/lib/libnvrtc-builtins.so.13.0"))
        .file(&format!("{site}/nccl/lib/libnccl.so.2"));
    let res = resolve(&t.search(&[("VIRTUAL_ENV", t.path("venv"))]));
    assert!(res.complete(), "{}", res.report());
    assert_eq!(chosen(&res, Library::Cublas).1, "13");
    assert_eq!(chosen(&res, Library::Nvrtc).1, "13");
    assert_eq!(chosen(&res, Library::Nccl).1, "2");
    // The link folder offers each under the name the bindings try first, and its own.
    let links = res.links();
    for name in [
        "libcuda.so",
        "libcublas.so",
        "libcublasLt.so",
        "libnvrtc.so",
        "libnccl.so",
    ] {
        assert!(links.iter().any(|(n, _)| n == name), "{name} in {links:?}");
    }
    assert!(links.iter().any(|(n, _)| n == "libcublas.so.13"));
    let base = t.path("links");
    std::fs::create_dir_all(&base).unwrap();
    let dir = link_folder(&res, &base).unwrap();
    assert_eq!(
        link_folder(&res, &base).unwrap(),
        dir,
        "reused, not made twice"
    );
    let target = std::fs::canonicalize(dir.join("libcublas.so")).unwrap();
    assert_eq!(target, chosen(&res, Library::Cublas).0);
    // The loader's path: the links first, the wheels' folders next, stubs dropped.
    let previous = OsString::from(format!("/opt/x/lib64/stubs:{}", t.path("other").display()));
    let path = res.library_path(&dir, Some(&previous));
    let dirs: Vec<PathBuf> = std::env::split_paths(&path).collect();
    assert_eq!(dirs[0], dir);
    assert!(dirs.contains(&t.path(&format!("{site}/cu13/lib"))));
    assert!(dirs.contains(&t.path("other")));
    assert!(!dirs.iter().any(|d| d.ends_with("stubs")), "{dirs:?}");
}

#[test]
fn cuda_12_and_13_side_by_side_give_the_newest_the_driver_runs() {
    for (driver_version, want) in [("580.159.04", "13"), ("550.54.15", "12")] {
        let t = Tree::new(&format!("mixed-{want}"));
        driver(&t, driver_version);
        toolkit(&t, "usr/local/cuda-12.8", 12, "12.8.4.1");
        toolkit(&t, "usr/local/cuda-13.0", 13, "13.1.0.3");
        let res = resolve(&t.search(&[]));
        assert!(res.complete(), "{}", res.report());
        for l in [Library::Cublas, Library::CublasLt, Library::Nvrtc] {
            let (_, version) = chosen(&res, l);
            assert!(
                version.starts_with(&format!("{want}.")),
                "{driver_version}: {l} {version}"
            );
        }
    }
}

#[test]
fn a_major_that_only_some_libraries_have_is_not_mixed_in() {
    // cuBLAS 13 from a wheel, NVRTC only in 12: CUDA 12 throughout, where all of it exists.
    let t = Tree::new("partial");
    driver(&t, "580.159.04");
    toolkit(&t, "usr/local/cuda-12.8", 12, "12.8.4.1");
    t.file("usr/local/lib/python3.11/dist-packages/nvidia/cublas/lib/libcublas.so.13");
    let res = resolve(&t.search(&[]));
    assert_eq!(chosen(&res, Library::Cublas).1, "12.8.4.1");
    assert_eq!(chosen(&res, Library::Nvrtc).1, "12.8.4.1");
}

#[test]
fn a_missing_library_is_reported_with_every_folder_searched() {
    let t = Tree::new("missing");
    driver(&t, "580.159.04");
    let lib = "usr/local/cuda/targets/x86_64-linux/lib";
    t.file(&format!("{lib}/libcublas.so.13"))
        .file(&format!("{lib}/libcublasLt.so.13"));
    t.file(&format!("{lib}/stubs/libnvrtc.so"));
    let res = resolve(&t.search(&[("LD_LIBRARY_PATH", t.path(&format!("{lib}/stubs")))]));
    assert!(!res.complete());
    let line = res.explain(Library::Nvrtc);
    assert!(line.starts_with("NVRTC not found"), "{line}");
    assert!(line.contains(&t.path(lib).display().to_string()), "{line}");
    assert!(
        line.contains("stubs"),
        "the stub passed over is named: {line}"
    );
    assert!(line.contains("/usr/local/nvidia/lib64"), "{line}");
}

#[test]
fn files_by_a_librarys_name_that_are_no_elf_object_are_passed_over_and_named() {
    let t = Tree::new("notelf");
    driver(&t, "580.159.04");
    toolkit(&t, "usr/local/cuda", 13, "13.1.0.3");
    // Earlier on the path than the real ones: a text file, an empty file, a folder and a
    // FIFO (which a read would wait on for ever), each by a library's name.
    t.bytes("planted/libcuda.so.1", b"not a library\n")
        .bytes("planted/libcublas.so.13", b"")
        .bytes("planted/libnvrtc.so.13/x", b"");
    let fifo = t.path("planted/libcublasLt.so.13");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let res = resolve(&t.search(&[("LD_LIBRARY_PATH", t.path("planted"))]));
    assert!(res.complete(), "{}", res.report());
    for l in [
        Library::Driver,
        Library::Cublas,
        Library::CublasLt,
        Library::Nvrtc,
    ] {
        let (path, _) = chosen(&res, l);
        assert!(!path.starts_with(t.path("planted")), "{l}: {path:?}");
    }
    assert_eq!(res.not_libraries.len(), 4, "{:?}", res.not_libraries);
    let report = res.report();
    assert!(
        report.contains("skipped files that are no ELF library")
            && report.contains("planted/libcuda.so.1"),
        "{report}"
    );
}

#[test]
fn only_a_stub_driver_is_no_driver() {
    let t = Tree::new("nodriver");
    toolkit(&t, "usr/local/cuda", 13, "13.1.0.3");
    let res = resolve(&t.search(&[]));
    assert!(res.get(Library::Driver).is_none());
    assert!(res.explain(Library::Driver).contains("driver not found"));
}

#[test]
fn a_driver_too_old_for_the_only_cuda_present_is_said_so() {
    let t = Tree::new("olddriver");
    driver(&t, "535.104.05");
    toolkit(&t, "usr/local/cuda", 13, "13.1.0.3");
    let res = resolve(&t.search(&[]));
    let line = res.explain(Library::Cublas);
    assert!(line.contains("13 needs 580+"), "{line}");
    assert!(Path::new(&chosen(&res, Library::Driver).0).exists());
}

#[test]
fn a_link_folder_that_is_not_exactly_ours_is_not_used() {
    let t = Tree::new("tamper");
    driver(&t, "580.159.04");
    toolkit(&t, "usr/local/cuda", 13, "13.1.0.3");
    let res = resolve(&t.search(&[]));
    let base = t.path("base");
    std::fs::create_dir_all(&base).unwrap();
    let dir = link_folder(&res, &base).unwrap();
    // Something planted in the folder, which the loader would search first: not used again.
    std::fs::write(dir.join("libcudart.so"), b"").unwrap();
    let other = link_folder(&res, &base).unwrap();
    assert_ne!(other, dir);
    assert!(!other.join("libcudart.so").exists());
    // A link bent elsewhere: the same.
    std::fs::remove_file(dir.join("libcudart.so")).unwrap();
    std::fs::remove_file(dir.join("libcuda.so")).unwrap();
    std::os::unix::fs::symlink("/elsewhere/libcuda.so", dir.join("libcuda.so")).unwrap();
    assert_ne!(link_folder(&res, &base).unwrap(), dir);
}
