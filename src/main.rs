//! The `pipe` command line. It only parses arguments, turns them into a validated `RunConfig`
//! once, wires observers (progress bar, JSON-lines log) and maps errors to exit codes: 2 for bad
//! input, 1 for failures at run time.

/// Prints to standard output like `print!`, except that a reader that has gone away (`pipe
/// plan | head`) ends the program quietly instead of panicking; see [`cli::write_out`].
macro_rules! out {
    ($($arg:tt)*) => { $crate::cli::write_out(format_args!($($arg)*)) };
}

/// [`out!`] with a newline, like `println!`.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::cli::write_out(format_args!("{}\n", format_args!($($arg)*))) };
}

mod cli;
mod partition_cli;
mod plan_cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    match cli::run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = cli::exit_code(&e);
            // One line: the error and its causes joined, no backtrace.
            let msg = e
                .chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ")
                .replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::from(code)
        }
    }
}
