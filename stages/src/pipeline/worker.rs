//! One worker of a run in this process, the others in other processes or on other hosts,
//! reached through one transport endpoint for the whole run (`pipe worker`). Rank 0 is the
//! *chief*: it settles what every worker must agree on, and at the end of every epoch gathers
//! what the in-process launcher reads from shared memory (each worker's epoch summary, the
//! weights of replica 0 of every stage), evaluates, and reports.
//!
//! Everything between workers travels as [`Kind::Control`] messages, so it needs nothing a
//! transport does not already offer:
//!
//! | topic | from -> to | index | carries |
//! |---|---|---|---|
//! | [`TOPIC_START`] | chief -> each | 0 | the chief's run settings and partition |
//! | [`TOPIC_SUMMARY`] | each -> chief | epoch | losses, compute time, staleness |
//! | [`TOPIC_WEIGHTS`] | replica 0 of a stage -> chief | epoch | one layer's tensors (step: layer) |
//! | [`TOPIC_GO`] | chief -> each | epoch | nothing: the epoch is over everywhere |
//!
//! The start exchange refuses a worker whose settings differ from the chief's (flags and
//! config must be the same everywhere, or the workers would run different programs), and
//! hands every worker the chief's cut when the partition is measured, so one machine's
//! profile decides it. The end-of-epoch exchange is also a barrier: no worker starts an epoch
//! before every worker has finished the previous one, so message keys, which restart with
//! each epoch's schedule, never meet their predecessors.

use std::time::Instant;

use pipe_kernels::{CpuBackend, Tensor};
use pipe_scheduler::Length;
use pipe_transport::{Key, Kind, Message, Transport, TransportError};

use super::train::{EpochEnd, Run, run_partition};
use super::{Partition, RunPlan, WorkerOutcome, WorkerState, run_worker};
use crate::config::{PartitionChoice, RunConfig};
use crate::data::Splits;
use crate::error::{Result, StageError};
use crate::model::{Model, Params};
use crate::train::{Observer, TrainReport};

/// Control topic: the chief's settings and partition, before the first epoch.
pub const TOPIC_START: u32 = 0;
/// Control topic: a worker's epoch summary.
pub const TOPIC_SUMMARY: u32 = 1;
/// Control topic: one layer's weights for the chief's evaluation.
pub const TOPIC_WEIGHTS: u32 = 2;
/// Control topic: the chief's end-of-epoch release.
pub const TOPIC_GO: u32 = 3;

/// The chief's rank.
pub const CHIEF: u32 = 0;

/// Runs this process's worker (`ep.rank()`) of `cfg` over `ep`, whose peers run the same call
/// in their processes. The chief reports steps and epochs to `obs` and returns the run's
/// report; every other worker returns `None`. On failure this worker's peers are told
/// ([`Transport::abort`]); the caller closes `ep` either way.
///
/// # Errors
/// Settings that differ from the chief's, a mesh of the wrong size, worker failures naming
/// the worker and action, lost peers naming the rank, a diverged loss.
pub fn train_worker<T: Transport + ?Sized>(
    cfg: &RunConfig,
    data: &Splits,
    ep: &mut T,
    obs: &mut dyn Observer,
) -> Result<Option<TrainReport>> {
    let result = run_epochs(cfg, data, ep, obs);
    if let Err(e) = &result {
        if !e.is_abort_echo() {
            ep.abort();
        }
    }
    result
}

fn run_epochs<T: Transport + ?Sized>(
    cfg: &RunConfig,
    data: &Splits,
    ep: &mut T,
    obs: &mut dyn Observer,
) -> Result<Option<TrainReport>> {
    let rank = ep.rank();
    let chief = rank == CHIEF;
    let run = Run::new(cfg, data)?;
    let layout = cfg.schedule_spec(Length::Updates(1)).resolve()?.layout;
    if layout.workers() != ep.size() {
        return Err(StageError::Config(format!(
            "this run needs {} workers ({} stages x replicas {:?}) but the cluster has {}",
            layout.workers(),
            layout.stages(),
            layout.replica_counts(),
            ep.size()
        )));
    }
    let partition = agree(cfg, &run.model, ep)?;
    let threads = cfg.threads.max(1);
    let be = CpuBackend::new(threads)?;
    let eval_be = CpuBackend::new(0)?;
    let init = run.model.init_params(cfg.seed);
    let mut state: Option<WorkerState> = None;
    let mut epochs = Vec::new();
    let mut params = init.clone();
    let mut done = 0u64;
    for epoch in 1..=cfg.epochs {
        let this = (run.total - done).min(run.per_epoch);
        if this == 0 {
            break;
        }
        let spec = cfg.schedule_spec(Length::Updates(this as u32));
        let plan = RunPlan::new(&run.model, &spec, partition.clone())?;
        let start = Instant::now();
        let outcome = run.with_setup(&plan, data, (epoch, done), None, |setup| {
            let st =
                state.get_or_insert_with(|| WorkerState::new(setup, rank, &init, cfg.optimizer));
            run_worker(&be, ep, setup, st, start)
        })?;
        let secs = start.elapsed().as_secs_f64();
        done += this;
        let mine = state
            .as_ref()
            .ok_or_else(|| StageError::Executor("a worker without state".into()))?;
        let index = epoch_index(epoch)?;
        if chief {
            let outcomes = gather_summaries(ep, outcome, index)?;
            params = gather_weights(ep, &plan, mine, &init, index)?;
            let ended = EpochEnd {
                plan: &plan,
                outcomes: &outcomes,
                epoch,
                done,
                this,
                before: 0,
                epoch_len: this,
                secs,
            };
            run.report_steps(&ended, obs)?;
            epochs.push(run.finish_epoch(&ended, &params, data, &eval_be, obs)?);
            for w in (0..ep.size()).filter(|&w| w != CHIEF) {
                ep.send(Message::from_bytes(
                    control(CHIEF, w, TOPIC_GO, index, 0),
                    &[],
                ))?;
            }
        } else {
            let bytes = encode_summary(&outcome);
            ep.send(Message::from_bytes(
                control(rank, CHIEF, TOPIC_SUMMARY, index, 0),
                &bytes,
            ))?;
            send_weights(ep, &plan, mine, index)?;
            ep.recv(&control(CHIEF, rank, TOPIC_GO, index, 0))?;
        }
    }
    Ok(chief.then_some(TrainReport {
        epochs,
        params,
        steps: done,
    }))
}

/// A control message's key.
fn control(from: u32, to: u32, topic: u32, index: u32, step: u32) -> Key {
    Key {
        from,
        to,
        kind: Kind::Control,
        stage: topic,
        index,
        step,
    }
}

fn epoch_index(epoch: u64) -> Result<u32> {
    u32::try_from(epoch).map_err(|_| StageError::Config(format!("epoch {epoch} is too large")))
}

/// The run settings that decide the numerics, as text every worker compares with the
/// chief's: what may differ between hosts (data paths, compute threads, logs) and the
/// partition (settled separately) are left out.
pub fn settings_fingerprint(cfg: &RunConfig) -> String {
    let mut c = cfg.clone();
    c.data_dir = None;
    c.threads = 0;
    c.log_jsonl = None;
    c.partition = PartitionChoice::Flops;
    format!("{c:#?}")
}

/// The start exchange: the chief settles the partition (measuring it if asked) and sends it
/// with its settings; every other worker checks the settings and takes the partition.
fn agree<T: Transport + ?Sized>(
    cfg: &RunConfig,
    model: &Model,
    ep: &mut T,
) -> Result<Option<Partition>> {
    let rank = ep.rank();
    let mine = settings_fingerprint(cfg);
    if rank == CHIEF {
        let partition = run_partition(cfg, model)?;
        let cut = partition
            .as_ref()
            .map_or("flops".to_string(), |p| p.to_string());
        let text = format!("{cut}\n{mine}");
        for w in 1..ep.size() {
            ep.send(Message::from_bytes(
                control(CHIEF, w, TOPIC_START, 0, 0),
                text.as_bytes(),
            ))?;
        }
        return Ok(partition);
    }
    let bytes = ep
        .recv(&control(CHIEF, rank, TOPIC_START, 0, 0))?
        .into_bytes()?;
    let text = String::from_utf8(bytes)
        .map_err(|_| protocol("the chief's settings are not text".into()))?;
    let (cut, theirs) = text.split_once('\n').unwrap_or((text.as_str(), ""));
    if let Some((a, b)) = mine.lines().zip(theirs.lines()).find(|(a, b)| a != b) {
        return Err(StageError::Config(format!(
            "worker {rank}'s run settings differ from the chief's (worker 0): `{}` here, `{}` there; give every worker the same flags and config",
            a.trim(),
            b.trim()
        )));
    }
    if mine.lines().count() != theirs.lines().count() {
        return Err(StageError::Config(format!(
            "worker {rank}'s run settings differ from the chief's (worker 0)"
        )));
    }
    let chiefs = PartitionChoice::parse(cut, model.len())?;
    Ok(match (&cfg.partition, chiefs) {
        (PartitionChoice::Given(p), PartitionChoice::Given(q)) if *p != q => {
            return Err(StageError::Config(format!(
                "worker {rank} was given partition {p} but the chief runs {q}"
            )));
        }
        (_, PartitionChoice::Given(q)) => Some(q),
        _ => None,
    })
}

fn protocol(why: String) -> StageError {
    StageError::Transport(TransportError::Protocol(why))
}

/// A worker's epoch summary as bytes: what the chief's reports need (not the per-action
/// records, which stay with the worker).
fn encode_summary(o: &WorkerOutcome) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + o.losses.len() * 20);
    b.extend_from_slice(&o.worker.to_le_bytes());
    b.extend_from_slice(&o.loss_sum.to_le_bytes());
    b.extend_from_slice(&(o.correct as u64).to_le_bytes());
    b.extend_from_slice(&(o.samples as u64).to_le_bytes());
    b.extend_from_slice(&o.compute_s.to_le_bytes());
    b.extend_from_slice(&o.staleness_sum.to_le_bytes());
    b.extend_from_slice(&o.staleness_count.to_le_bytes());
    b.extend_from_slice(&o.peak_versions.to_le_bytes());
    b.extend_from_slice(&(o.losses.len() as u64).to_le_bytes());
    for &(mb, loss, n) in &o.losses {
        b.extend_from_slice(&mb.to_le_bytes());
        b.extend_from_slice(&loss.to_le_bytes());
        b.extend_from_slice(&(n as u64).to_le_bytes());
    }
    b
}

/// Reads little-endian fields from a peer's bytes, failing (never panicking) at the end.
struct Fields<'b>(&'b [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N]> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or_else(|| protocol("a worker's epoch summary is truncated".into()))?;
        self.0 = rest;
        Ok(*head)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn usize(&mut self) -> Result<usize> {
        usize::try_from(self.u64()?).map_err(|_| protocol("a count beyond this machine".into()))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.take()?))
    }
}

/// The inverse of [`encode_summary`]; `from` must be the worker the summary names.
fn decode_summary(bytes: &[u8], from: u32) -> Result<WorkerOutcome> {
    let mut f = Fields(bytes);
    let worker = f.u32()?;
    if worker != from {
        return Err(protocol(format!(
            "worker {from} sent the summary of worker {worker}"
        )));
    }
    let loss_sum = f.f64()?;
    let correct = f.usize()?;
    let samples = f.usize()?;
    let compute_s = f.f64()?;
    let staleness_sum = f.f64()?;
    let staleness_count = f.u64()?;
    let peak_versions = f.u32()?;
    let n = f.usize()?;
    // Each record is 20 bytes: a count beyond what is left is a lie, refused before any
    // allocation.
    if n > f.0.len() / 20 {
        return Err(protocol(format!(
            "worker {from}'s summary claims {n} losses in {} bytes",
            f.0.len()
        )));
    }
    let losses = (0..n)
        .map(|_| Ok((f.u32()?, f.f64()?, f.usize()?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(WorkerOutcome {
        worker,
        versions: Vec::new(),
        spans: Vec::new(),
        loss_sum,
        correct,
        samples,
        compute_s,
        staleness_sum,
        staleness_count,
        peak_versions,
        losses,
    })
}

/// Every worker's summary of epoch `index`, in worker order (the chief's own is `own`).
fn gather_summaries<T: Transport + ?Sized>(
    ep: &mut T,
    own: WorkerOutcome,
    index: u32,
) -> Result<Vec<WorkerOutcome>> {
    let mut out = vec![own];
    for w in 1..ep.size() {
        let bytes = ep
            .recv(&control(w, CHIEF, TOPIC_SUMMARY, index, 0))?
            .into_bytes()?;
        out.push(decode_summary(&bytes, w)?);
    }
    Ok(out)
}

/// The stages whose replica 0 `state`'s worker is.
fn first_replica_stages<'s>(
    plan: &'s RunPlan,
    state: &'s WorkerState,
) -> impl Iterator<Item = &'s super::StageState> + 's {
    let layout = plan.schedule.layout();
    state
        .stages
        .iter()
        .filter(move |st| layout.worker_for(st.stage, 0) == state.worker)
}

/// Sends the weights of every stage this worker is replica 0 of, one message per layer.
fn send_weights<T: Transport + ?Sized>(
    ep: &mut T,
    plan: &RunPlan,
    state: &WorkerState,
    index: u32,
) -> Result<()> {
    for st in first_replica_stages(plan, state) {
        let first = plan.partition.range(st.stage as usize).start;
        for (i, layer) in st.params.iter().enumerate() {
            let mut flat = Vec::new();
            for t in layer {
                flat.extend_from_slice(t.host()?);
            }
            let n = flat.len();
            let key = control(
                state.worker,
                CHIEF,
                TOPIC_WEIGHTS,
                index,
                (first + i) as u32,
            );
            ep.send(Message {
                key,
                version: 0,
                tensor: Tensor::from_vec(&[n], flat)?,
            })?;
        }
    }
    Ok(())
}

/// The whole model's weights after epoch `index`: the chief's own stages from `own`, the
/// others' from their messages, each checked against the layer shapes of `like`.
fn gather_weights<T: Transport + ?Sized>(
    ep: &mut T,
    plan: &RunPlan,
    own: &WorkerState,
    like: &Params,
    index: u32,
) -> Result<Params> {
    let mut params: Params = like.clone();
    for st in first_replica_stages(plan, own) {
        let first = plan.partition.range(st.stage as usize).start;
        for (i, layer) in st.params.iter().enumerate() {
            params[first + i] = layer.clone();
        }
    }
    let layout = plan.schedule.layout();
    for s in 0..plan.schedule.stages() {
        let w = layout.worker_for(s, 0);
        if w == CHIEF {
            continue;
        }
        for layer in plan.partition.range(s as usize) {
            let m = ep.recv(&control(w, CHIEF, TOPIC_WEIGHTS, index, layer as u32))?;
            let flat = m.tensor.host()?;
            let want: usize = params[layer].iter().map(Tensor::len).sum();
            if flat.len() != want {
                return Err(protocol(format!(
                    "worker {w} sent {} weights for layer {layer}, which has {want}",
                    flat.len()
                )));
            }
            let mut at = 0;
            for t in &mut params[layer] {
                let n = t.len();
                t.host_mut()?.copy_from_slice(&flat[at..at + n]);
                at += n;
            }
        }
    }
    Ok(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome() -> WorkerOutcome {
        WorkerOutcome {
            worker: 3,
            versions: Vec::new(),
            spans: Vec::new(),
            loss_sum: 1.25,
            correct: 7,
            samples: 64,
            compute_s: 0.5,
            staleness_sum: f64::from_bits(0x3ff0_0000_0000_0001),
            staleness_count: 9,
            peak_versions: 4,
            losses: vec![(0, 0.75, 32), (5, 0.5, 32)],
        }
    }

    #[test]
    fn summaries_round_trip_bit_for_bit() {
        let o = outcome();
        let back = decode_summary(&encode_summary(&o), 3).unwrap();
        assert_eq!(back.losses, o.losses);
        assert_eq!(back.staleness_sum.to_bits(), o.staleness_sum.to_bits());
        assert_eq!((back.correct, back.samples, back.peak_versions), (7, 64, 4));
    }

    #[test]
    fn hostile_summaries_are_refused() {
        let bytes = encode_summary(&outcome());
        for cut in 0..bytes.len() {
            assert!(decode_summary(&bytes[..cut], 3).is_err(), "cut {cut}");
        }
        assert!(decode_summary(&bytes, 2).is_err());
        let mut lie = bytes.clone();
        // The loss count says far more records than the bytes hold.
        let at = 4 + 8 * 6 + 4;
        lie[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decode_summary(&lie, 3).is_err());
    }
}
