//! When each of a worker's actions ran, the spans its timeline, utilisation and the planner's
//! accuracy are read from.
//!
//! On a backend that computes as it is called (the CPU) an action's span is the host's clock
//! around it. A device backend only queues an action's kernels, so a span read that way needs
//! a wait for the device after every action ([`Backend::synchronize`]), and the worker then
//! queues nothing more until its stream has drained: on one GPU shared by several workers, the
//! GPU waits for each host thread in turn. Where the backend marks its queue
//! ([`Backend::mark`]: CUDA events), the worker queues a mark before and after each action
//! instead and reads their times once the device has passed them (at each action the spans
//! already passed, at the program's end the rest), measured from an origin mark queued, with
//! the stream empty, at a known time of the host's clock. The spans are then the device's,
//! and the worker runs ahead of its device as far as its messages let it.
//!
//! A device fault in an action is then reported by the next call that waits for the device
//! (a later action, a loss, the update's guard, or the program's end), not by the action
//! itself.

use std::collections::VecDeque;
use std::time::Instant;

use pipe_kernels::{Backend, DeviceMark};
use pipe_scheduler::{Action, Span};

use crate::error::Result;

/// The clock of one worker's program (see the module docs).
pub(super) struct ActionClock {
    t0: Instant,
    worker: u32,
    device: Option<DeviceClock>,
}

/// Marks of the device, and the actions whose marks have not been read yet.
struct DeviceClock {
    origin: Box<dyn DeviceMark>,
    /// The host's clock at the origin, seconds from `t0`.
    origin_s: f64,
    pending: VecDeque<Pending>,
}

/// An action queued between two marks.
struct Pending {
    action: Action,
    compute: bool,
    start: Box<dyn DeviceMark>,
    end: Box<dyn DeviceMark>,
}

/// The start of an action: the host's clock, or a mark.
pub(super) enum Opened {
    Host(f64),
    Device(Box<dyn DeviceMark>),
}

/// One action's span and whether it computed (a forward, backward or update pass).
pub(super) struct Timed {
    pub(super) span: Span,
    pub(super) compute: bool,
}

impl ActionClock {
    /// A clock for `worker`'s program on `be`, its times in seconds from `t0`. Where `be`
    /// marks, waits for the device once, to queue the origin with nothing before it.
    ///
    /// # Errors
    /// Device failures.
    pub(super) fn new<B: Backend + ?Sized>(be: &B, t0: Instant, worker: u32) -> Result<Self> {
        be.synchronize()?;
        let device = be.mark()?.map(|origin| DeviceClock {
            origin,
            origin_s: t0.elapsed().as_secs_f64(),
            pending: VecDeque::new(),
        });
        Ok(ActionClock { t0, worker, device })
    }

    /// Opens an action about to be queued.
    ///
    /// # Errors
    /// Device failures.
    pub(super) fn open<B: Backend + ?Sized>(&self, be: &B) -> Result<Opened> {
        if self.device.is_some()
            && let Some(mark) = be.mark()?
        {
            return Ok(Opened::Device(mark));
        }
        Ok(Opened::Host(self.t0.elapsed().as_secs_f64()))
    }

    /// Closes `action`, opened by `opened` and now queued: on the host's clock, waits for the
    /// device and gives its span; on marks, queues the end mark and gives the spans of every
    /// earlier action the device has passed, oldest first.
    ///
    /// # Errors
    /// Device failures.
    pub(super) fn close<B: Backend + ?Sized>(
        &mut self,
        be: &B,
        opened: Opened,
        action: Action,
        compute: bool,
    ) -> Result<Vec<Timed>> {
        let start = match opened {
            Opened::Host(start) => {
                be.synchronize()?;
                let end = self.t0.elapsed().as_secs_f64();
                return Ok(vec![self.timed(action, compute, start, end)]);
            }
            Opened::Device(start) => start,
        };
        let end = match be.mark()? {
            Some(end) => end,
            // A backend marks every time or never; waiting is the safe answer either way.
            None => {
                be.synchronize()?;
                Box::new(pipe_kernels::HostMark(Instant::now()))
            }
        };
        if let Some(device) = &mut self.device {
            device.pending.push_back(Pending {
                action,
                compute,
                start,
                end,
            });
        }
        self.read(false)
    }

    /// The spans of every action not read yet, waiting for the device to pass them (at the
    /// program's end).
    ///
    /// # Errors
    /// Device failures.
    pub(super) fn finish(&mut self) -> Result<Vec<Timed>> {
        self.read(true)
    }

    /// Reads the pending actions in order while the device has passed them (all of them when
    /// `wait`).
    fn read(&mut self, wait: bool) -> Result<Vec<Timed>> {
        let Some(device) = &mut self.device else {
            return Ok(Vec::new());
        };
        let mut done = Vec::new();
        while let Some(p) = device.pending.front() {
            if !wait && !p.end.passed()? {
                break;
            }
            let start = device.origin_s + p.start.seconds_since(device.origin.as_ref())?;
            let end = device.origin_s + p.end.seconds_since(device.origin.as_ref())?;
            let (action, compute) = (p.action, p.compute);
            device.pending.pop_front();
            done.push(Timed {
                span: Span {
                    worker: self.worker,
                    action,
                    start,
                    end: end.max(start),
                },
                compute,
            });
        }
        Ok(done)
    }

    fn timed(&self, action: Action, compute: bool, start: f64, end: f64) -> Timed {
        Timed {
            span: Span {
                worker: self.worker,
                action,
                start,
                end,
            },
            compute,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A mark at `at` seconds after the origin, passed once `passed` is set.
    #[derive(Debug)]
    struct Fake {
        at: f64,
        passed: Arc<AtomicBool>,
    }

    impl DeviceMark for Fake {
        fn passed(&self) -> pipe_kernels::Result<bool> {
            Ok(self.passed.load(Ordering::SeqCst))
        }
        fn seconds_since(&self, origin: &dyn DeviceMark) -> pipe_kernels::Result<f64> {
            let origin = origin.as_any().downcast_ref::<Fake>().map_or(0.0, |o| o.at);
            Ok(self.at - origin)
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn fake(at: f64, passed: &Arc<AtomicBool>) -> Box<dyn DeviceMark> {
        Box::new(Fake {
            at,
            passed: Arc::clone(passed),
        })
    }

    /// Spans are read in program order, only once the device has passed their end (a later
    /// action's passed end waits behind an earlier one's), at the origin's host time plus the
    /// device's seconds; the program's end reads the rest.
    #[test]
    fn spans_are_read_in_order_once_the_device_has_passed_them() {
        let yes = Arc::new(AtomicBool::new(true));
        let (first, second) = (Arc::new(AtomicBool::new(false)), Arc::clone(&yes));
        let mut clock = ActionClock {
            t0: Instant::now(),
            worker: 2,
            device: Some(DeviceClock {
                origin: fake(10.0, &yes),
                origin_s: 1.5,
                pending: VecDeque::new(),
            }),
        };
        let forward = Action::Forward { stage: 1, mb: 0 };
        let send = Action::SendActivation {
            stage: 1,
            mb: 0,
            to: 3,
        };
        let pending = |action, compute, (start, end), passed: &Arc<AtomicBool>| Pending {
            action,
            compute,
            start: fake(start, &yes),
            end: fake(end, passed),
        };
        let device = clock.device.as_mut().unwrap();
        device
            .pending
            .push_back(pending(forward, true, (10.25, 10.75), &first));
        device
            .pending
            .push_back(pending(send, false, (10.75, 11.0), &second));
        assert!(
            clock.read(false).unwrap().is_empty(),
            "the first has not passed"
        );
        first.store(true, Ordering::SeqCst);
        let read = clock.read(false).unwrap();
        let spans: Vec<_> = read
            .iter()
            .map(|t| (t.span.action, t.span.start, t.span.end))
            .collect();
        assert_eq!(spans, [(forward, 1.75, 2.25), (send, 2.25, 2.5)]);
        assert_eq!(
            read.iter().map(|t| t.compute).collect::<Vec<_>>(),
            [true, false]
        );
        assert!(read.iter().all(|t| t.span.worker == 2));
        let device = clock.device.as_mut().unwrap();
        device.pending.push_back(pending(
            forward,
            true,
            (11.0, 12.0),
            &Arc::new(AtomicBool::new(false)),
        ));
        assert_eq!(
            clock.finish().unwrap().len(),
            1,
            "the program's end reads every span"
        );
        assert!(clock.finish().unwrap().is_empty());
    }
}
