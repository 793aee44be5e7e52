//! Bounded fuzzing of every parser that reads a user's or a peer's bytes, run by CI on every
//! change: TOML configs (parsed, then resolved as `pipe train` would), plan files, both profile
//! formats and IDX files. Each target gets arbitrary bytes and mutations of a valid input
//! (bytes flipped, inserted, deleted, the input cut short), and must return a value or an error,
//! never panic. `PIPE_FUZZ_CASES` raises the case count for a longer run (`docs/reliability.md`
//! gives the figures of one); libFuzzer targets over the same functions live in `fuzz/`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use pipe_scheduler::Profile;
use pipe_stages::config::{PlanFile, TrainSettings};
use pipe_stages::data::parse_idx;
use proptest::prelude::*;

fn cases(default: u32) -> u32 {
    std::env::var("PIPE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

const CONFIG: &str = r#"epochs = 1
steps = 2
microbatch_size = 8
lr = 0.05
stages = 2
replicas = [1, 1]
schedule = "pipedream"
dataset = "synthetic"

[synthetic]
train = 64
test = 16

[model]
input = [784]
layers = [
  { type = "flatten" },
  { type = "linear", inputs = 784, outputs = 16 },
  { type = "relu" },
  { type = "residual", layers = [ { type = "linear", inputs = 16, outputs = 16, init = "zeros" } ] },
  { type = "linear", inputs = 16, outputs = 10 },
]
"#;

const PLAN: &str = "model = \"mlp-784-1024x4-10\"\nmicrobatch_size = 64\nschedule = \"pipedream\"\nmicrobatches = 4\npartition = \"0-3,4-8\"\nreplicas = [1, 1]\ncost_model = \"default\"\ntime_per_microbatch = 0.01\n";

const PROFILE: &str = r#"{"model": "m", "microbatch_size": 64, "layers": [{"name": "a", "forward": 0.001, "backward_input": 0.002, "backward_weight": 0.001, "activation_bytes": 4096, "param_bytes": 1024}, {"name": "b", "forward": 0.001, "backward_input": 0.001, "activation_bytes": 40, "param_bytes": 0}], "edges": [[0, 1]]}"#;

const GRAPH: &str = "node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000\nnode2 -- Linear -- forward_compute_time=2.000, backward_compute_time=3.000, activation_size=[10.0; 5.0], parameter_size=50.000\nnode3 -- ReLU -- forward_compute_time=1.000, backward_compute_time=1.000, activation_size=10.0, parameter_size=0.000\n\tnode1 -- node2\n\tnode2 -- node3\n";

/// A valid 4 x 2 x 3 IDX file.
fn idx() -> Vec<u8> {
    let mut b = vec![0, 0, 8, 3, 0, 0, 0, 4, 0, 0, 0, 2, 0, 0, 0, 3];
    b.extend(0..24u8);
    b
}

/// One edit of a byte string.
#[derive(Clone, Debug)]
enum Edit {
    Flip(usize, u8),
    Insert(usize, u8),
    Delete(usize),
    Cut(usize),
    Digit(usize, u8),
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Edit::Insert(i, b)),
        any::<usize>().prop_map(Edit::Delete),
        any::<usize>().prop_map(Edit::Cut),
        (any::<usize>(), b'0'..=b'9').prop_map(|(i, d)| Edit::Digit(i, d)),
    ];
    prop::collection::vec(edit, 1..6)
}

/// `base` with `edits` applied (positions taken modulo the length).
fn mutate(base: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut b = base.to_vec();
    for e in edits {
        let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
        match *e {
            Edit::Flip(i, x) if !b.is_empty() => {
                let i = at(i, b.len());
                b[i] ^= x;
            }
            Edit::Insert(i, x) => {
                let i = at(i, b.len() + 1);
                b.insert(i, x);
            }
            Edit::Delete(i) if !b.is_empty() => {
                let i = at(i, b.len());
                b.remove(i);
            }
            Edit::Cut(i) => b.truncate(at(i, b.len() + 1)),
            // A digit changed where one stands: sizes and counts turn huge or zero.
            Edit::Digit(i, d) => {
                if let Some(j) = (0..b.len())
                    .map(|k| (at(i, b.len().max(1)) + k) % b.len().max(1))
                    .find(|&j| b.get(j).is_some_and(u8::is_ascii_digit))
                {
                    b[j] = d;
                    b.insert(j, d);
                }
            }
            _ => {}
        }
    }
    b
}

fn config(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    if let Ok(settings) = TrainSettings::from_toml(&text, "fuzz.toml") {
        // Resolving builds the model and checks every limit; it must not panic either.
        let _ = settings.resolve();
    }
}

fn plan(bytes: &[u8]) {
    let _ = PlanFile::parse(&String::from_utf8_lossy(bytes), "fuzz.toml");
}

fn profiles(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    if let Ok(p) = Profile::from_json(&text) {
        p.check_file().unwrap();
    }
    if let Ok(p) = Profile::from_pipedream(&text) {
        p.check_file().unwrap();
    }
}

fn idx_file(bytes: &[u8]) {
    if let Ok(i) = parse_idx(bytes, "fuzz") {
        assert_eq!(i.data.len(), i.dims.iter().product::<usize>());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(300)))]

    #[test]
    fn configs_never_panic(e in edits()) {
        config(&mutate(CONFIG.as_bytes(), &e));
    }

    #[test]
    fn plans_never_panic(e in edits()) {
        plan(&mutate(PLAN.as_bytes(), &e));
    }

    #[test]
    fn json_profiles_never_panic(e in edits()) {
        profiles(&mutate(PROFILE.as_bytes(), &e));
    }

    #[test]
    fn pipedream_profiles_never_panic(e in edits()) {
        profiles(&mutate(GRAPH.as_bytes(), &e));
    }

    #[test]
    fn idx_files_never_panic(e in edits()) {
        idx_file(&mutate(&idx(), &e));
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        config(&bytes);
        plan(&bytes);
        profiles(&bytes);
        idx_file(&bytes);
    }
}

/// The mutations reach past the parsers' first checks: of single-digit edits of the valid
/// config (the cheapest way to a huge or zero size), most still parse, and some resolve; so
/// the targets above exercise the limits and the model checks, not only the TOML error path.
#[test]
fn mutations_reach_the_checks_behind_the_parser() {
    let (mut parsed, mut resolved, mut refused) = (0, 0, 0);
    for i in 0..400usize {
        let edits = [Edit::Digit(i * 7919, b'0' + (i % 10) as u8)];
        let text = String::from_utf8(mutate(CONFIG.as_bytes(), &edits)).unwrap();
        if let Ok(s) = TrainSettings::from_toml(&text, "fuzz.toml") {
            parsed += 1;
            match s.resolve() {
                Ok(_) => resolved += 1,
                Err(_) => refused += 1,
            }
        }
    }
    eprintln!("400 digit edits: {parsed} parsed, {resolved} resolved, {refused} refused");
    assert!(parsed > 200 && resolved > 20 && refused > 20);
}
