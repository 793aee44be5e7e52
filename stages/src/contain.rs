//! Calls into libraries that panic, instead of returning an error, on input a user gave them.
//!
//! The `tokenizers` library, and the `onig` regex engine under it, panic on some inputs a
//! hostile `tokenizer.json` sets up: a pattern that backtracks past the engine's retry limit
//! (`(a|a)+$` on forty `a`s), or a precompiled character map whose trie points outside itself.
//! pipe reads such files from users, so these panics are bad input, to be reported as one
//! line with exit code 2, not crashes. [`call`] runs a library call and turns its panic into an
//! `Err` carrying the panic's message. The process's panic hook would still print the panic
//! where it happened; [`quiet_contained_panics`] wraps the hook so that it stays silent for a
//! panic [`call`] is about to catch, which the caller then reports once, as an error.
//!
//! What a contained panic left behind is the library's own state (a cache, say); callers stop
//! using the value after an error, as after any other failure of it.

use std::any::Any;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    /// How many [`call`]s this thread is inside: a panic here is caught and reported by them.
    static CONTAINING: Cell<u32> = const { Cell::new(0) };
}

/// Runs `f`, returning its panic's message as an `Err` instead of unwinding further.
///
/// # Errors
/// The message of the panic `f` raised.
pub fn call<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    CONTAINING.with(|c| c.set(c.get() + 1));
    let result = catch_unwind(AssertUnwindSafe(f));
    CONTAINING.with(|c| c.set(c.get() - 1));
    result.map_err(|payload| panic_message(payload.as_ref()))
}

/// Whether a panic on this thread now would be caught by [`call`].
pub fn is_containing() -> bool {
    CONTAINING.with(|c| c.get() > 0)
}

/// The text of a panic's payload (`panic!`'s message), or "panic" for another payload.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Wraps the process's panic hook so that it prints nothing for a panic [`call`] catches
/// (the caller reports it as an error), and everything it printed before for any other. The
/// binary calls it once at start; a library leaves the process's hook to its program.
pub fn quiet_contained_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !is_containing() {
            previous(info);
        }
    }));
}

#[cfg(test)]
mod tests {
    use super::{call, is_containing};

    #[test]
    fn a_panic_becomes_its_message_and_the_thread_goes_on() {
        assert_eq!(call(|| 7), Ok(7));
        let got: Result<(), String> = call(|| panic!("retry-limit-in-match over"));
        assert_eq!(got, Err("retry-limit-in-match over".to_string()));
        let n = 3;
        let got: Result<(), String> = call(|| panic!("formatted {n}"));
        assert_eq!(got, Err("formatted 3".to_string()));
        assert!(!is_containing());
        // Nested calls: the inner catches, the outer is still containing after it.
        let outer = call(|| {
            let inner: Result<(), String> = call(|| panic!("inner"));
            (inner, is_containing())
        });
        assert_eq!(outer, Ok((Err("inner".to_string()), true)));
        assert!(!is_containing());
    }
}
