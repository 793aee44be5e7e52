//! A `pipe train` config on arbitrary bytes: parsed, then resolved (the model built and every
//! limit checked) as the command would. It must return settings or an error, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pipe_stages::config::TrainSettings;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(settings) = TrainSettings::from_toml(&text, "fuzz.toml") {
        let _ = settings.resolve();
    }
});
