//! Cost files on arbitrary bytes: the simulator's (`pipe simulate --costs`, TOML and JSON),
//! checked for one stage and for four, and a transport cost file (`--transport-costs`).
//! Each is a checked value or an error; a checked cost model simulates to finite figures.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_scheduler::planner::transport::TransportCosts;
use pipe_scheduler::sim::{CostModel, SimOptions, simulate_spec};
use pipe_scheduler::spec::{Policy, ScheduleSpec};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for json in [false, true] {
        let Ok(costs) = CostModel::parse(&text, json) else {
            continue;
        };
        for stages in [1, 4] {
            if costs.check_input(stages).is_ok() && costs.stages.len() <= 4 {
                let spec = ScheduleSpec::new(Policy::PipeDream, stages, 2);
                if let Ok(report) = simulate_spec(&spec, &costs, SimOptions::default()) {
                    assert!(report.makespan.is_finite());
                }
            }
        }
    }
    let _ = TransportCosts::parse(&text);
});
