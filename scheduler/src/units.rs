//! Times, sizes and rates as reports print them and flags take them: seconds in s, ms or us,
//! bytes in powers of 1024, and the parsers of `--latency 5us`, `--memory 16GiB` and
//! `--bandwidth 10GB/s` (powers of 10 for KB, MB, GB; of 2 for KiB, MiB, GiB).

/// Seconds for a report: `0`, or four decimals in s or ms, or three in us.
pub fn secs(s: f64) -> String {
    if s == 0.0 {
        "0".into()
    } else if s >= 1.0 {
        format!("{s:.4} s")
    } else if s >= 1e-3 {
        format!("{:.4} ms", s * 1e3)
    } else {
        format!("{:.3} us", s * 1e6)
    }
}

/// Bytes for a report, in powers of 1024: `512 B`, `1.50 MiB`.
pub fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

/// Splits `text` into a number and a unit suffix.
fn split_unit(text: &str) -> Result<(f64, String), String> {
    let t = text.trim();
    let end = t
        .find(|c: char| {
            !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+')
        })
        .unwrap_or(t.len());
    // An exponent letter followed by a unit letter ("5e" + "ms") is not a number; back off.
    let (num, unit) = t.split_at(end);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a number with an optional unit"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!("{text:?} must be a finite number >= 0"));
    }
    Ok((value, unit.trim().to_string()))
}

/// Seconds, with an optional unit: s, ms, us, ns; at most
/// [`crate::limits::MAX_FIGURE_SECONDS`], as every time a cost file gives.
///
/// # Errors
/// A message naming the text: not a number, negative, an unknown unit, or past the bound.
pub fn parse_seconds(text: &str) -> Result<f64, String> {
    let v = seconds(text)?;
    crate::limits::check_figure(&format!("the time {text:?}"), v)?;
    Ok(v)
}

/// [`parse_seconds`] without the bound.
fn seconds(text: &str) -> Result<f64, String> {
    let (v, unit) = split_unit(text)?;
    let scale = match unit.as_str() {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        other => return Err(format!("unknown time unit {other:?} (use s, ms, us or ns)")),
    };
    Ok(v * scale)
}

/// Bytes, with an optional unit: B, KB, MB, GB (powers of 10) or KiB, MiB, GiB (powers of 2);
/// at most [`crate::limits::MAX_FIGURE_BYTES`], as every size a cost file gives.
///
/// # Errors
/// A message naming the text: not a number, negative, an unknown unit, or past the bound.
pub fn parse_bytes(text: &str) -> Result<f64, String> {
    let v = byte_count(text)?;
    crate::limits::check_figure(&format!("the size {text:?} in bytes"), v)?;
    Ok(v)
}

/// [`parse_bytes`] without the bound.
fn byte_count(text: &str) -> Result<f64, String> {
    let (v, unit) = split_unit(text)?;
    let scale = match unit.as_str() {
        "" | "B" => 1.0,
        "KB" | "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024.0f64.powi(4),
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KB, MB, GB, KiB, MiB, GiB)"
            ));
        }
    };
    Ok(v * scale)
}

/// Bytes per second: a size with an optional `/s` (10GB/s, 1.25e9).
///
/// # Errors
/// As [`parse_bytes`] but for the bound; a rate under a byte a second
/// ([`crate::limits::check_bandwidth`]).
pub fn parse_bandwidth(text: &str) -> Result<f64, String> {
    let t = text.trim();
    let v = byte_count(t.strip_suffix("/s").unwrap_or(t))?;
    crate::limits::check_bandwidth(&format!("bandwidth {text:?}"), v)?;
    Ok(v)
}

/// A size as `transformers` writes it: bytes, or a number with KB, MB, GB (powers of 1,000)
/// or KiB, MiB, GiB (powers of 1,024).
///
/// # Errors
/// The one-line message naming what is wrong.
pub fn parse_shard_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KIB" => 1 << 10,
        "MIB" => 1 << 20,
        "GIB" => 1 << 30,
        other => {
            return Err(format!(
                "unknown unit {other:?}: use B, KB, MB, GB, KiB, MiB or GiB"
            ));
        }
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (a whole number, then a unit: 500MB)"))?;
    match n.checked_mul(scale) {
        Some(0) => Err("a shard must hold at least one byte".into()),
        Some(v) => Ok(v),
        None => Err(format!("{text} is past 2^64 bytes")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_parse() {
        assert_eq!(parse_seconds("2ms"), Ok(2e-3));
        assert_eq!(parse_seconds("1.5"), Ok(1.5));
        assert_eq!(parse_seconds("150us"), Ok(150e-6));
        assert_eq!(parse_bandwidth("10GB/s"), Ok(1e10));
        assert_eq!(parse_bandwidth("1GiB/s"), Ok(1073741824.0));
        assert_eq!(parse_bytes("4MiB"), Ok(4194304.0));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("3 fortnights").is_err());
        assert!(parse_bandwidth("0GB/s").is_err());
        assert!(parse_bytes("NaN").is_err());
        // The bounds of a cost file's figures: 11 days, 1 PiB, a byte a second.
        assert_eq!(parse_seconds("1e6"), Ok(1e6));
        assert!(
            parse_seconds("1e300")
                .unwrap_err()
                .contains("over the limit")
        );
        assert!(
            parse_bytes("2048TiB")
                .unwrap_err()
                .contains("over the limit")
        );
        assert_eq!(parse_bandwidth("1B/s"), Ok(1.0));
        assert!(
            parse_bandwidth("1e-300B/s")
                .unwrap_err()
                .contains("at least 1 byte/s")
        );
        assert!(parse_bandwidth("1e300B/s").is_ok());
    }
}
