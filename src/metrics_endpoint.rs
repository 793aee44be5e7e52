//! The Prometheus endpoint of `--metrics-addr`: the `metrics` crate's values rendered by
//! `metrics-exporter-prometheus`, served over HTTP with bounds.
//!
//! The exporter's own listener buffered a request's headers up to 400 KB a connection and
//! held connections without end or count: any local process could open thousands of
//! half-sent requests and abort the training run out of memory, or hold its file descriptors
//! until its next checkpoint failed. A scrape is one small `GET`, so pipe answers it itself:
//! at most [`MAX_CONNECTIONS`] at once (others are closed at once), a request of at most
//! [`MAX_REQUEST_BYTES`] received within [`REQUEST_DEADLINE`], one response, then the
//! connection is closed. The exporter builds the recorder and renders the text.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Connections served at once; a scraper needs one.
pub const MAX_CONNECTIONS: usize = 32;
/// The largest request read (a scrape's is under 1 KiB).
pub const MAX_REQUEST_BYTES: usize = 8 << 10;
/// How long a client has to send its request.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// How often histograms are folded into their summaries when nobody scrapes (the exporter's
/// own period).
const UPKEEP_PERIOD: Duration = Duration::from_secs(5);

/// Installs the recorder and serves it at `addr`; returns the address served (a port of 0
/// becomes the one the system chose).
///
/// # Errors
/// The address cannot be listened on, or a recorder is installed already.
pub fn serve(addr: SocketAddr) -> std::result::Result<SocketAddr, String> {
    let listener = TcpListener::bind(addr).map_err(|e| e.to_string())?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| e.to_string())?;
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("pipe-metrics-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_PERIOD);
                upkeep.run_upkeep();
            }
        })
        .map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("pipe-metrics".into())
        .spawn(move || accept(&listener, &handle))
        .map_err(|e| e.to_string())?;
    Ok(bound)
}

/// Accepts connections for good, each answered on a thread of its own while under
/// [`MAX_CONNECTIONS`].
fn accept(listener: &TcpListener, handle: &PrometheusHandle) {
    let open = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else {
            // Out of descriptors, say: wait rather than spin.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            open.fetch_sub(1, Ordering::SeqCst);
            drop(stream);
            continue;
        }
        let (count, handle) = (open.clone(), handle.clone());
        let spawned = std::thread::Builder::new()
            .name("pipe-metrics-conn".into())
            .spawn(move || {
                let _ = answer(stream, &|| {
                    handle.run_upkeep();
                    handle.render()
                });
                count.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// What a request asked for.
#[derive(Debug, PartialEq, Eq)]
enum Asked {
    Metrics,
    Status(&'static str),
}

/// Reads one request from `stream` within the bounds and writes its response.
fn answer(mut stream: TcpStream, render: &dyn Fn() -> String) -> std::io::Result<()> {
    stream.set_write_timeout(Some(REQUEST_DEADLINE))?;
    let asked = match read_request(&mut stream)? {
        Some(head) => route(&head),
        None => Asked::Status("431 Request Header Fields Too Large"),
    };
    let (status, body) = match asked {
        Asked::Metrics => ("200 OK", render()),
        Asked::Status(status) => (status, format!("{status}\n")),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}

/// The request's head (up to its blank line), or `None` past [`MAX_REQUEST_BYTES`].
///
/// # Errors
/// Past [`REQUEST_DEADLINE`], or the client gone.
fn read_request(stream: &mut TcpStream) -> std::io::Result<Option<Vec<u8>>> {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if head.len() + n > MAX_REQUEST_BYTES {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(Some(head))
}

/// `GET /metrics` (or `/`) is a scrape; anything else an error status.
fn route(head: &[u8]) -> Asked {
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    match (words.next(), words.next()) {
        (Some(b"GET"), Some(path)) => {
            let path = path.split(|&b| b == b'?').next().unwrap_or_default();
            if path == b"/metrics" || path == b"/" {
                Asked::Metrics
            } else {
                Asked::Status("404 Not Found")
            }
        }
        (Some(_), Some(_)) => Asked::Status("405 Method Not Allowed"),
        _ => Asked::Status("400 Bad Request"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn requests_are_routed_by_method_and_path() {
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\n\r\n"), Asked::Metrics);
        assert_eq!(route(b"GET /?x=1 HTTP/1.0\r\n\r\n"), Asked::Metrics);
        assert_eq!(
            route(b"GET /other HTTP/1.1\r\n\r\n"),
            Asked::Status("404 Not Found")
        );
        assert_eq!(
            route(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Asked::Status("405 Method Not Allowed")
        );
        assert_eq!(route(b"\x00\xff\r\n\r\n"), Asked::Status("400 Bad Request"));
    }

    /// A server on a free port answering with `answer`, and its address.
    fn server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || answer(stream, &|| "up 1\n".into()));
            }
        });
        addr
    }

    fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(request);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    #[test]
    fn a_scrape_is_answered_and_an_oversized_or_endless_request_is_not_held() {
        let addr = server();
        let got = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            got.starts_with("HTTP/1.1 200 OK") && got.ends_with("up 1\n"),
            "{got}"
        );
        // Headers past the bound: refused once they pass it, whatever follows.
        let mut big = b"GET /metrics HTTP/1.1\r\nX-a: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', 2 * MAX_REQUEST_BYTES));
        let got = exchange(addr, &big);
        assert!(got.starts_with("HTTP/1.1 431"), "{got}");
        // A request never finished: the connection is closed at the deadline.
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nX-a: ").unwrap();
        let t0 = Instant::now();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let waited = t0.elapsed();
        assert!(out.is_empty(), "{out:?}");
        assert!(
            waited < REQUEST_DEADLINE + Duration::from_secs(5),
            "{waited:?}"
        );
    }
}
