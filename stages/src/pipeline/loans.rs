//! Activations and gradients between worker processes of one host, lent device to device.
//!
//! Where a worker's backend holds a data message's tensor on a device and its link to the
//! receiver is to another process of the same host with an f32 wire
//! ([`Transport::lends_device_buffers`]), the sender does not copy the tensor out through host
//! memory: it lends its device buffer ([`Backend::lend`], a CUDA IPC handle) and sends a loan in
//! the message's place. The receiver copies the lent buffer into its own device memory
//! ([`Backend::copy_lent`]) and returns the loan. Until the loan comes back, the sender holds
//! the tensor, so its buffer is neither freed nor reused; a worker settles every loan before
//! its program ends. Everywhere else the tensor is copied to the host as before, and a
//! receiver places what it is sent.
//!
//! **A loan on the wire.** It is the data message itself, under its own key, with
//! [`LOAN`] set in its version and a payload of words: a magic number, the loan's number, the
//! tensor's shape and the backend's handle. The receiver recognises it by the version, so it
//! needs no knowledge of what the sender chose; a payload that does not read as a loan is a
//! protocol error naming it. The return is a [`Kind::Control`] message of topic
//! [`TOPIC_RETURNED`] numbered as the loan, with no payload.
//!
//! **Agreed per link first.** Whether a device can open another's buffer depends on the pair
//! (two GPUs without peer access cannot), so before its program each worker lends each peer it
//! sends data to a one-value probe, answers the probes of the peers it receives from with
//! whether it could copy them, and lends on a link only where the answer was yes; elsewhere
//! its tensors go through the host as before. Every worker sends all its probes before it
//! waits for any, so the exchange cannot deadlock, and both ends derive the links from the
//! same program of the schedule.
//!
//! A transport that keeps copies of messages to replay them after a loss (the traffic log of
//! an in-place recovery) lends nothing, so a kept message is always a payload.

use std::collections::{BTreeSet, VecDeque};

use pipe_kernels::{Backend, Device, Tensor};
use pipe_scheduler::Action;
use pipe_transport::{Key, Kind, Message, Transport, TransportError};

use crate::{Result, StageError};

/// The bit of [`Message::version`] that marks a loan; a version it would overwrite is never
/// lent (the message goes through the host).
pub const LOAN: u64 = 1 << 63;

/// The control topic of a returned loan.
pub const TOPIC_RETURNED: u32 = 10;

/// The control topic of the probes before a program (index 0: a probe loan, 1: its answer).
pub const TOPIC_PROBE: u32 = 11;

/// The first word of a loan's payload.
const MAGIC: u32 = u32::from_le_bytes(*b"PLN1");

/// The most dimensions a lent tensor has.
const MAX_DIMS: usize = 8;

/// The longest handle a backend gives.
const MAX_HANDLE_BYTES: usize = 256;

/// Loans a worker may have out before it waits for the oldest to come back. A schedule keeps
/// far fewer messages in flight on a link; this only bounds what a stalled receiver holds.
const MAX_OUT: usize = 1024;

/// One loan as it travels: its number, the tensor's shape and the backend's handle.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Loan {
    number: u32,
    shape: Vec<usize>,
    handle: Vec<u8>,
}

fn protocol(key: &Key, why: impl std::fmt::Display) -> StageError {
    StageError::Transport(TransportError::Protocol(format!("{key:?}: a loan {why}")))
}

impl Loan {
    /// The payload's words (each a `u32` as an `f32`'s bits, as a control record's bytes are);
    /// `None` for a loan its receiver would refuse (then the message is not lent).
    fn words(&self) -> Option<Vec<f32>> {
        let handle_fits = (1..=MAX_HANDLE_BYTES).contains(&self.handle.len());
        if self.shape.len() > MAX_DIMS || !handle_fits {
            return None;
        }
        let mut words = vec![MAGIC, self.number, self.shape.len() as u32];
        for &d in &self.shape {
            words.push(u32::try_from(d).ok()?);
        }
        words.push(self.handle.len() as u32);
        words.extend(self.handle.chunks(4).map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        }));
        Some(words.into_iter().map(f32::from_bits).collect())
    }

    /// The payload of a message carrying this loan; `None` as [`Loan::words`].
    fn payload(&self) -> Result<Option<Tensor>> {
        let Some(words) = self.words() else {
            return Ok(None);
        };
        Ok(Some(Tensor::from_vec(&[words.len()], words)?))
    }

    /// The loan message `m` carries.
    fn of(m: &Message) -> Result<Loan> {
        let values = m
            .tensor
            .host()
            .map_err(|e| protocol(&m.key, format!("is not in host memory: {e}")))?;
        Loan::read(&m.key, values)
    }

    /// The loan `values` carry, every length checked against what is there.
    fn read(key: &Key, values: &[f32]) -> Result<Loan> {
        let mut words = values.iter().map(|v| v.to_bits());
        let mut next = |what: &str| {
            words
                .next()
                .ok_or_else(|| protocol(key, format!("ends before its {what}")))
        };
        if next("magic number")? != MAGIC {
            return Err(protocol(key, "does not start with its magic number"));
        }
        let number = next("number")?;
        let dims = next("rank")? as usize;
        if dims > MAX_DIMS {
            return Err(protocol(
                key,
                format!("has {dims} dimensions, over {MAX_DIMS}"),
            ));
        }
        let shape = (0..dims)
            .map(|_| next("shape").map(|d| d as usize))
            .collect::<Result<Vec<usize>>>()?;
        let len = next("handle's length")? as usize;
        if len == 0 || len > MAX_HANDLE_BYTES {
            return Err(protocol(key, format!("has a handle of {len} bytes")));
        }
        let mut handle = Vec::with_capacity(len);
        while handle.len() < len {
            handle.extend_from_slice(&next("handle")?.to_le_bytes());
        }
        handle.truncate(len);
        if words.next().is_some() {
            return Err(protocol(key, "has words after its handle"));
        }
        Ok(Loan {
            number,
            shape,
            handle,
        })
    }
}

/// The key of the return of loan `number` from `borrower` to `lender`.
fn returned(borrower: u32, lender: u32, number: u32) -> Key {
    Key {
        from: borrower,
        to: lender,
        kind: Kind::Control,
        stage: TOPIC_RETURNED,
        index: number,
        step: 0,
    }
}

/// The key of a probe (`answer` false) from `from` to `to`, or of its answer.
fn probe(from: u32, to: u32, answer: bool) -> Key {
    Key {
        from,
        to,
        kind: Kind::Control,
        stage: TOPIC_PROBE,
        index: u32::from(answer),
        step: 0,
    }
}

/// The peers `program` sends data messages to and receives them from.
fn data_peers(program: &[Action]) -> (BTreeSet<u32>, BTreeSet<u32>) {
    let (mut to, mut from) = (BTreeSet::new(), BTreeSet::new());
    for a in program {
        match *a {
            Action::SendActivation { to: p, .. } | Action::SendGradient { to: p, .. } => {
                to.insert(p);
            }
            Action::RecvActivation { from: p, .. } | Action::RecvGradient { from: p, .. } => {
                from.insert(p);
            }
            _ => {}
        }
    }
    (to, from)
}

/// A sending worker's loans: the peers it lends to, and those not yet returned (each the
/// borrower, the number and the tensor whose buffer is lent).
#[derive(Debug, Default)]
pub struct Loans {
    lend_to: BTreeSet<u32>,
    out: VecDeque<(u32, u32, Tensor)>,
    next: u32,
    lent: u64,
}

impl Loans {
    /// Agrees with the peers of `program`'s data messages, over the links that lend device
    /// buffers, where loans will be made: probes every peer it sends to, answers every peer
    /// it receives from, then reads its answers (the module's "Agreed per link first").
    ///
    /// # Errors
    /// The transport's and the backend's; a probe that does not read as a loan.
    pub fn agree<T: Transport + ?Sized>(
        &mut self,
        be: &dyn Backend,
        t: &mut T,
        program: &[Action],
    ) -> Result<()> {
        self.lend_to.clear();
        if be.device() == Device::Host || t.carries_device_tensors() {
            return Ok(());
        }
        let me = t.rank();
        let (mut to, mut from) = data_peers(program);
        to.retain(|&p| t.lends_device_buffers(p));
        from.retain(|&p| t.lends_device_buffers(p));
        if to.is_empty() && from.is_empty() {
            return Ok(());
        }
        // Held until every answer is in, so each borrower copies it while it is lent.
        let value = be.place(Tensor::from_vec(&[1], vec![0.0])?)?;
        for &p in &to {
            // A loan per peer, as every data message is its own loan; an empty probe where
            // the backend lends nothing.
            let loan = match be.lend(&value)? {
                Some(handle) => Loan {
                    number: 0,
                    shape: vec![1],
                    handle,
                }
                .payload()?,
                None => None,
            };
            let tensor = loan.map_or_else(|| Tensor::from_vec(&[0], Vec::new()), Ok)?;
            t.send(Message {
                key: probe(me, p, false),
                version: 0,
                tensor,
            })?;
        }
        for &p in &from {
            let m = t.recv(&probe(p, me, false))?;
            let copied = Loan::of(&m)
                .and_then(|l| Ok(be.copy_lent(&l.handle, &l.shape)?))
                .is_ok();
            t.send(Message::from_bytes(probe(me, p, true), &[u8::from(copied)]))?;
        }
        for &p in &to {
            if t.recv(&probe(p, me, true))?.into_bytes()? == [1] {
                self.lend_to.insert(p);
            }
        }
        Ok(())
    }

    /// Sends data message `m`: its tensor as it is where the transport carries device
    /// tensors, lent where the link lends device buffers and the backend lends this one,
    /// copied to the host otherwise.
    ///
    /// # Errors
    /// The transport's and the backend's.
    pub fn send<T: Transport + ?Sized>(
        &mut self,
        be: &dyn Backend,
        t: &mut T,
        mut m: Message,
    ) -> Result<()> {
        if t.carries_device_tensors() {
            return Ok(t.send(m)?);
        }
        // `lend_to` holds only peers whose links lend ([`Loans::agree`]).
        let lendable = m.tensor.device() != Device::Host
            && m.version < LOAN
            && self.lend_to.contains(&m.key.to);
        if lendable {
            self.collect_returns(t)?;
            if let Some(handle) = be.lend(&m.tensor)? {
                let loan = Loan {
                    number: self.next,
                    shape: m.tensor.shape().to_vec(),
                    handle,
                };
                if let Some(tensor) = loan.payload()? {
                    self.next = self.next.wrapping_add(1);
                    let (key, version) = (m.key, m.version | LOAN);
                    t.send(Message {
                        key,
                        version,
                        tensor,
                    })?;
                    self.out.push_back((key.to, loan.number, m.tensor));
                    self.lent += 1;
                    return Ok(());
                }
            }
        }
        m.tensor = crate::model::host_tensor(be, m.tensor)?;
        Ok(t.send(m)?)
    }

    /// Drops the loans that have come back, without waiting; then, while more than
    /// [`MAX_OUT`] are out, waits for the oldest.
    fn collect_returns<T: Transport + ?Sized>(&mut self, t: &mut T) -> Result<()> {
        let me = t.rank();
        let mut failed = None;
        self.out.retain(|&(borrower, number, _)| {
            match t.try_recv(&returned(borrower, me, number)) {
                Ok(back) => back.is_none(),
                Err(e) => {
                    failed.get_or_insert(e);
                    true
                }
            }
        });
        if let Some(e) = failed {
            return Err(e.into());
        }
        while self.out.len() >= MAX_OUT {
            if let Some((borrower, number, _)) = self.out.pop_front() {
                t.recv(&returned(borrower, me, number))?;
            }
        }
        Ok(())
    }

    /// Waits until every loan has come back: the end of a worker's program, after which no
    /// peer reads its buffers.
    ///
    /// # Errors
    /// The transport's (a borrower that failed).
    pub fn settle<T: Transport + ?Sized>(&mut self, t: &mut T) -> Result<()> {
        let me = t.rank();
        while let Some((borrower, number, _)) = self.out.pop_front() {
            t.recv(&returned(borrower, me, number))?;
        }
        Ok(())
    }

    /// Loans made so far.
    pub fn lent(&self) -> u64 {
        self.lent
    }
}

/// Receives the data message with `key` as a tensor of `be`: a loan copied from the lender's
/// device and returned to it, anything else placed.
///
/// # Errors
/// The transport's; a payload marked as a loan that does not read as one; the backend's
/// refusal of the handle.
pub fn receive<T: Transport + ?Sized>(be: &dyn Backend, t: &mut T, key: &Key) -> Result<Message> {
    let mut m = t.recv(key)?;
    if m.version & LOAN == 0 {
        m.tensor = be.place(m.tensor)?;
        return Ok(m);
    }
    let loan = Loan::of(&m)?;
    m.tensor = be.copy_lent(&loan.handle, &loan.shape)?;
    m.version &= !LOAN;
    t.send(Message::from_bytes(
        returned(key.to, key.from, loan.number),
        &[],
    ))?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key::data(0, 1, Kind::Activation, 3)
    }

    fn loan() -> Loan {
        Loan {
            number: 7,
            shape: vec![4, 1024, 768],
            handle: (0u8..84).collect(),
        }
    }

    #[test]
    fn a_loan_reads_back_as_written() {
        for handle in [vec![1u8], vec![1, 2, 3, 4], (0u8..84).collect::<Vec<u8>>()] {
            let loan = Loan { handle, ..loan() };
            let words = loan.words().unwrap();
            assert_eq!(Loan::read(&key(), &words).unwrap(), loan);
        }
    }

    /// Every truncation, and every word changed to a hostile value, is refused with a message
    /// naming the loan, never a panic or an allocation of what the words claim.
    #[test]
    fn a_bad_loan_is_a_protocol_error() {
        let words = loan().words().unwrap();
        for cut in 0..words.len() {
            let e = Loan::read(&key(), &words[..cut]).unwrap_err().to_string();
            assert!(e.contains("a loan ends before"), "{cut}: {e}");
        }
        let mut longer = words.clone();
        longer.push(0.0);
        let e = Loan::read(&key(), &longer).unwrap_err().to_string();
        assert!(e.contains("words after its handle"), "{e}");
        for (at, bad, says) in [
            (0, 0u32, "magic number"),
            (2, 9, "9 dimensions"),
            (2, u32::MAX, "dimensions"),
            (6, 0, "handle of 0 bytes"),
            (6, u32::MAX, "bytes"),
            (6, 257, "handle of 257 bytes"),
        ] {
            let mut w = words.clone();
            w[at] = f32::from_bits(bad);
            let e = Loan::read(&key(), &w).unwrap_err().to_string();
            assert!(e.contains(says), "word {at} = {bad}: {e}");
        }
    }

    /// What a receiver would refuse is not lent (the message goes through the host): a
    /// dimension past `u32`, too many dimensions, an empty or too long handle.
    #[test]
    fn what_a_receiver_refuses_is_not_lent() {
        for loan in [
            Loan {
                shape: vec![usize::try_from(u64::from(u32::MAX) + 1).unwrap_or(usize::MAX)],
                ..loan()
            },
            Loan {
                shape: vec![1; MAX_DIMS + 1],
                ..loan()
            },
            Loan {
                handle: Vec::new(),
                ..loan()
            },
            Loan {
                handle: vec![7; MAX_HANDLE_BYTES + 1],
                ..loan()
            },
        ] {
            assert!(loan.words().is_none(), "{loan:?}");
        }
        let widest = Loan {
            shape: vec![2; MAX_DIMS],
            handle: vec![7; MAX_HANDLE_BYTES],
            ..loan()
        };
        assert_eq!(
            Loan::read(&key(), &widest.words().unwrap()).unwrap(),
            widest
        );
    }
}
