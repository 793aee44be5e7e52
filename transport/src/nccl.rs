//! NCCL all-reduce for the replicas of a stage on GPUs (behind the `cuda` feature).
//!
//! A replica group's communicator is made on the group's first all-reduce: every member sends
//! whether it can load NCCL and its GPU's UUID to the group's first worker over the transport
//! (so over the QUIC control channel between processes), which answers every member with whether
//! NCCL serves the group (every member can load it, one rank per GPU: NCCL refuses two ranks on
//! one device) and, if so, a fresh NCCL id; then all members join with `ncclCommInitRank`. The
//! decision is the leader's, so the members never disagree on it. A group NCCL cannot serve
//! keeps the ring all-reduce through the host, as do CPU workers and builds without the feature.
//!
//! The sums are queued on each worker's backend stream, in order with its kernels, so no
//! synchronisation is added.

use std::collections::HashMap;

use pipe_kernels::{Backend, CudaBackend, Tensor};

use crate::{Key, Kind, Message, Transport, TransportError};

/// The `step` of the messages that set up a group's communicator (ring chunks use small steps
/// and tied gradients `u32::MAX`).
pub const NCCL_SETUP_STEP: u32 = u32::MAX - 1;

/// What a group's first worker decided.
enum GroupComm {
    /// NCCL sums the group's gradients.
    #[cfg(feature = "cuda")]
    Nccl(imp::Comm),
    /// The ring through the host does (two members share a GPU).
    HostRing,
}

/// One worker's NCCL communicators, one per replica group it belongs to, made on first use.
#[derive(Default)]
pub struct NcclComms {
    by_stage: HashMap<u32, GroupComm>,
}

impl std::fmt::Debug for NcclComms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComms")
            .field("groups", &self.by_stage.len())
            .finish()
    }
}

fn setup_key(from: u32, to: u32, stage: u32, index: u32) -> Key {
    Key {
        from,
        to,
        kind: Kind::Control,
        stage,
        index,
        step: NCCL_SETUP_STEP,
    }
}

fn nccl_err(what: &str, e: impl std::fmt::Display) -> TransportError {
    TransportError::Setup(format!("nccl {what}: {e}"))
}

impl NcclComms {
    /// Whether this worker could take part in NCCL all-reduces of `be`'s tensors: a CUDA
    /// backend, in a build with the feature, where the NCCL library loads. (A group uses NCCL
    /// only when every member could.)
    pub fn available(be: &dyn Backend) -> bool {
        #[cfg(feature = "cuda")]
        {
            CudaBackend::of(be).is_some() && imp::library_present()
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = be;
            false
        }
    }

    /// Sums `tensors` in place across `group` (worker ranks in ring order, this worker among
    /// them) with NCCL, making the group's communicator on first use (see the module docs).
    /// Returns `false`, having changed nothing, when the group does not use NCCL (CPU workers, a
    /// member without NCCL, members sharing a GPU): the caller sums through the host. Every
    /// member of a group gets the same answer.
    ///
    /// # Errors
    /// Transport errors while setting up; NCCL or device failures.
    pub fn all_reduce<T: Transport + ?Sized>(
        &mut self,
        t: &mut T,
        be: &dyn Backend,
        group: &[u32],
        stage: u32,
        tensors: Vec<&mut Tensor>,
    ) -> Result<bool, TransportError> {
        // Every worker of a run has the same kind of backend, so CPU groups skip the exchange
        // together.
        if group.len() < 2 || CudaBackend::of(be).is_none() {
            return Ok(false);
        }
        let comm = match self.by_stage.entry(stage) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Self::set_up(t, be, group, stage)?)
            }
        };
        match comm {
            #[cfg(feature = "cuda")]
            GroupComm::Nccl(comm) => {
                imp::all_reduce(comm, be, tensors)?;
                Ok(true)
            }
            GroupComm::HostRing => {
                let _ = tensors;
                Ok(false)
            }
        }
    }

    /// Makes the group's communicator: [`agree`] on it, then join.
    fn set_up<T: Transport + ?Sized>(
        t: &mut T,
        be: &dyn Backend,
        group: &[u32],
        stage: u32,
    ) -> Result<GroupComm, TransportError> {
        let me = t.rank();
        let rank = group
            .iter()
            .position(|&w| w == me)
            .ok_or_else(|| TransportError::Setup(format!("worker {me} is not in {group:?}")))?;
        let hello = Hello {
            usable: Self::available(be),
            device: device_uuid(be)?,
        };
        match agree(t, group, stage, hello, new_id)? {
            Some(id) => join(be, rank, group.len(), &id),
            None => Ok(GroupComm::HostRing),
        }
    }
}

/// What a member tells the group's first worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Whether it can load NCCL.
    pub usable: bool,
    /// Its GPU's UUID.
    pub device: Vec<u8>,
}

impl Hello {
    fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![u8::from(self.usable)];
        b.extend_from_slice(&self.device);
        b
    }

    fn from_bytes(b: &[u8]) -> Result<Self, TransportError> {
        match b.split_first() {
            Some((&flag, device)) if flag <= 1 => Ok(Hello {
                usable: flag == 1,
                device: device.to_vec(),
            }),
            _ => Err(TransportError::Protocol(
                "a malformed NCCL set-up greeting".into(),
            )),
        }
    }
}

/// The set-up exchange of a replica group: every member sends its [`Hello`] to the group's
/// first worker, which answers every member with the NCCL id it makes with `make_id` when every
/// member can use NCCL and all the devices differ, or with a refusal. Returns the id, the same
/// for every member, or `None` for every member when the group keeps the host ring.
///
/// # Errors
/// Transport errors; a malformed greeting or answer.
pub fn agree<T: Transport + ?Sized>(
    t: &mut T,
    group: &[u32],
    stage: u32,
    hello: Hello,
    make_id: impl FnOnce() -> Result<Vec<u8>, TransportError>,
) -> Result<Option<Vec<u8>>, TransportError> {
    let me = t.rank();
    let leader = group
        .first()
        .copied()
        .ok_or_else(|| TransportError::Setup("an empty replica group".into()))?;
    let answer = if me == leader {
        let mut hellos = vec![hello];
        for &w in &group[1..] {
            let m = t.recv(&setup_key(w, me, stage, 0))?;
            hellos.push(Hello::from_bytes(&m.into_bytes()?)?);
        }
        let distinct =
            (1..hellos.len()).all(|i| hellos[..i].iter().all(|h| h.device != hellos[i].device));
        let nccl = distinct && hellos.iter().all(|h| h.usable);
        let mut answer = vec![u8::from(nccl)];
        if nccl {
            answer.extend_from_slice(&make_id()?);
        }
        for &w in &group[1..] {
            t.send(Message::from_bytes(setup_key(me, w, stage, 1), &answer))?;
        }
        answer
    } else {
        t.send(Message::from_bytes(
            setup_key(me, leader, stage, 0),
            &hello.to_bytes(),
        ))?;
        t.recv(&setup_key(leader, me, stage, 1))?.into_bytes()?
    };
    match answer.split_first() {
        Some((&1, id)) => Ok(Some(id.to_vec())),
        Some((&0, [])) => Ok(None),
        _ => Err(TransportError::Protocol(format!(
            "stage {stage}: malformed NCCL set-up answer of {} bytes",
            answer.len()
        ))),
    }
}

#[cfg(feature = "cuda")]
fn device_uuid(be: &dyn Backend) -> Result<Vec<u8>, TransportError> {
    let cuda = CudaBackend::of(be)
        .ok_or_else(|| TransportError::Setup("NCCL needs the CUDA backend".into()))?;
    Ok(cuda
        .device_uuid()
        .map_err(|e| nccl_err("device", e))?
        .to_vec())
}

#[cfg(not(feature = "cuda"))]
fn device_uuid(_be: &dyn Backend) -> Result<Vec<u8>, TransportError> {
    Err(nccl_err("setup", "built without CUDA"))
}

#[cfg(feature = "cuda")]
fn new_id() -> Result<Vec<u8>, TransportError> {
    imp::new_id()
}

#[cfg(not(feature = "cuda"))]
fn new_id() -> Result<Vec<u8>, TransportError> {
    Err(nccl_err("id", "built without CUDA"))
}

#[cfg(feature = "cuda")]
fn join(
    be: &dyn Backend,
    rank: usize,
    size: usize,
    id: &[u8],
) -> Result<GroupComm, TransportError> {
    imp::join(be, rank, size, id).map(GroupComm::Nccl)
}

#[cfg(not(feature = "cuda"))]
fn join(
    _be: &dyn Backend,
    _rank: usize,
    _size: usize,
    _id: &[u8],
) -> Result<GroupComm, TransportError> {
    Err(nccl_err("join", "built without CUDA"))
}

#[cfg(feature = "cuda")]
mod imp {
    use std::ffi::c_void;
    use std::mem::MaybeUninit;

    use cudarc::nccl::{result, sys};
    use pipe_kernels::{Backend, CudaBackend, Tensor};

    use super::nccl_err;
    use crate::TransportError;

    /// An NCCL communicator: destroyed on drop, or aborted when a collective on it failed
    /// (destroying waits for outstanding work, which a failed rank never completes).
    pub(super) struct Comm {
        raw: sys::ncclComm_t,
        failed: bool,
    }

    // SAFETY: a communicator is used by the one worker thread that owns it; NCCL handles may be
    // moved between threads.
    unsafe impl Send for Comm {}

    impl Drop for Comm {
        fn drop(&mut self) {
            // SAFETY: the handle came from ncclCommInitRank and is released once.
            let _ = unsafe {
                if self.failed {
                    result::comm_abort(self.raw)
                } else {
                    result::comm_destroy(self.raw)
                }
            };
        }
    }

    pub(super) fn library_present() -> bool {
        // SAFETY: only tries to open the shared library.
        unsafe { sys::is_culib_present() }
    }

    pub(super) fn new_id() -> Result<Vec<u8>, TransportError> {
        let id = result::get_uniqueid().map_err(|e| nccl_err("id", format!("{e:?}")))?;
        Ok(id.internal.iter().map(|&b| b as u8).collect())
    }

    pub(super) fn join(
        be: &dyn Backend,
        rank: usize,
        size: usize,
        id: &[u8],
    ) -> Result<Comm, TransportError> {
        let cuda = CudaBackend::of(be)
            .ok_or_else(|| TransportError::Setup("NCCL needs the CUDA backend".into()))?;
        let mut internal = [0 as std::ffi::c_char; 128];
        if id.len() != internal.len() {
            return Err(TransportError::Protocol(format!(
                "an NCCL id has 128 bytes, got {}",
                id.len()
            )));
        }
        for (d, &s) in internal.iter_mut().zip(id) {
            *d = s as std::ffi::c_char;
        }
        cuda.bind().map_err(|e| nccl_err("bind", e))?;
        let (ranks, me) = (
            i32::try_from(size).map_err(|e| nccl_err("group size", e))?,
            i32::try_from(rank).map_err(|e| nccl_err("rank", e))?,
        );
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` receives the handle; the id is the leader's, sent to every member.
        unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), ranks, sys::ncclUniqueId { internal }, me)
        }
        .map_err(|e| nccl_err("init", format!("{e:?}")))?;
        // SAFETY: initialised by the successful call above.
        Ok(Comm {
            raw: unsafe { comm.assume_init() },
            failed: false,
        })
    }

    /// Queues one grouped in-place sum of every tensor on the backend's stream. A failure marks
    /// the communicator failed (it is aborted when dropped) and stops the worker; its peers'
    /// sums then never complete, which NCCL has no time-out for (see docs/gpu.md).
    pub(super) fn all_reduce(
        comm: &mut Comm,
        be: &dyn Backend,
        tensors: Vec<&mut Tensor>,
    ) -> Result<(), TransportError> {
        let result = queue_sums(comm, be, tensors);
        if result.is_err() {
            comm.failed = true;
        }
        result
    }

    fn queue_sums(
        comm: &Comm,
        be: &dyn Backend,
        tensors: Vec<&mut Tensor>,
    ) -> Result<(), TransportError> {
        let cuda = CudaBackend::of(be)
            .ok_or_else(|| TransportError::Setup("NCCL needs the CUDA backend".into()))?;
        let stream = cuda.raw_stream();
        // Every operand is made this backend's own before the group opens, so a failure here
        // leaves no half-queued group.
        let mut operands = Vec::with_capacity(tensors.len());
        for t in tensors {
            if !t.is_empty() {
                let ptr = cuda.raw_in_place(t).map_err(|e| nccl_err("operand", e))?;
                operands.push((ptr, t.len()));
            }
        }
        result::group_start().map_err(|e| nccl_err("group start", format!("{e:?}")))?;
        let mut queued = Ok(());
        for (ptr, len) in operands {
            // SAFETY: `ptr` is this backend's buffer of `len` floats, alive until the stream
            // has run the sum (the caller keeps the tensors); the sum is in place.
            let r = unsafe {
                result::all_reduce(
                    ptr as *const c_void,
                    ptr as *mut c_void,
                    len,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    comm.raw,
                    stream as sys::cudaStream_t,
                )
            };
            if let Err(e) = r {
                queued = Err(nccl_err("all-reduce", format!("{e:?}")));
                break;
            }
        }
        // The group is closed whatever happened inside it.
        let ended = result::group_end().map_err(|e| nccl_err("group end", format!("{e:?}")));
        queued.and(ended.map(|_| ()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::inproc::{InProcOptions, mesh};

    /// Runs the exchange on one thread per member of a four-worker mesh whose group is workers
    /// 3, 1 and 2 (leader 3), each with the given device id.
    fn exchange(devices: [u8; 3], usable: [bool; 3]) -> Vec<Option<Vec<u8>>> {
        let group = [3u32, 1, 2];
        let mut eps: Vec<_> = mesh(4, &InProcOptions::default())
            .into_iter()
            .map(Some)
            .collect();
        let handles: Vec<_> = group
            .iter()
            .zip(devices.into_iter().zip(usable))
            .map(|(&w, (device, usable))| {
                let mut ep = eps[w as usize].take().unwrap();
                std::thread::spawn(move || {
                    let hello = Hello {
                        usable,
                        device: vec![device; 16],
                    };
                    agree(&mut ep, &group, 5, hello, || Ok(vec![7u8; 128])).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn a_group_on_distinct_devices_shares_one_id() {
        let got = exchange([1, 2, 3], [true; 3]);
        assert!(
            got.iter().all(|id| id.as_deref() == Some(&[7u8; 128][..])),
            "{got:?}"
        );
    }

    #[test]
    fn a_group_sharing_a_device_keeps_the_host_ring() {
        assert_eq!(exchange([4, 9, 4], [true; 3]), vec![None, None, None]);
    }

    #[test]
    fn a_member_without_nccl_keeps_the_whole_group_on_the_host_ring() {
        assert_eq!(
            exchange([1, 2, 3], [true, false, true]),
            vec![None, None, None]
        );
    }

    #[test]
    fn cpu_backends_never_use_nccl() {
        let be = pipe_kernels::CpuBackend::new(1).unwrap();
        assert!(!NcclComms::available(&be));
        let mut ep = mesh(1, &InProcOptions::default()).pop().unwrap();
        let mut t = pipe_kernels::Tensor::zeros(&[4]);
        let used = NcclComms::default()
            .all_reduce(&mut ep, &be, &[0, 1], 0, vec![&mut t])
            .unwrap();
        assert!(!used, "a CPU worker sums through the ring");
    }
}
