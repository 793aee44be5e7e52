//! The identity of a host, as the kernel gives it: its boot id and this process's network
//! namespace. Two processes with the same identity can share memory and reach each other's
//! Unix sockets; two network namespaces of one machine count as two hosts, so that a run that
//! simulates hosts with namespaces keeps their network links. Shared memory checks it at
//! admission; QUIC's hellos carry it, so that a cluster's workers of one host can find each
//! other ([`crate::kinds`]).

use std::os::unix::fs::MetadataExt;

use crate::TransportError;

/// What makes two processes one host: the kernel's boot id and the network namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HostId {
    /// `/proc/sys/kernel/random/boot_id`, its 36 characters.
    pub boot: [u8; 36],
    /// Device and inode of `/proc/self/ns/net`.
    pub netns: (u64, u64),
}

impl HostId {
    /// This process's host identity.
    ///
    /// # Errors
    /// [`TransportError::Setup`] where `/proc` does not say.
    pub fn current() -> Result<HostId, TransportError> {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|e| TransportError::Setup(format!("reading the kernel's boot id: {e}")))?;
        let mut boot = [0u8; 36];
        let t = text.trim().as_bytes();
        if t.len() != boot.len() {
            return Err(TransportError::Setup(format!(
                "boot id '{}' is not a UUID",
                text.trim()
            )));
        }
        boot.copy_from_slice(t);
        let ns = std::fs::metadata("/proc/self/ns/net")
            .map_err(|e| TransportError::Setup(format!("reading the network namespace: {e}")))?;
        Ok(HostId {
            boot,
            netns: (ns.dev(), ns.ino()),
        })
    }

    /// Bytes of an encoded host identity.
    pub const BYTES: usize = 36 + 16;

    /// Appends the identity's [`HostId::BYTES`] bytes to `out`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.boot);
        out.extend_from_slice(&self.netns.0.to_le_bytes());
        out.extend_from_slice(&self.netns.1.to_le_bytes());
    }

    /// Reads what [`HostId::encode`] wrote from `bytes` (at least [`HostId::BYTES`] long;
    /// missing bytes read as zeros, an identity no host has).
    pub(crate) fn decode(bytes: &[u8]) -> HostId {
        let mut all = [0u8; HostId::BYTES];
        let n = bytes.len().min(HostId::BYTES);
        all[..n].copy_from_slice(&bytes[..n]);
        let mut boot = [0u8; 36];
        boot.copy_from_slice(&all[..36]);
        let word = |at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&all[at..at + 8]);
            u64::from_le_bytes(w)
        };
        HostId {
            boot,
            netns: (word(36), word(44)),
        }
    }
}
