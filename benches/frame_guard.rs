//! What the frame guard costs per message, in one process: the bytes a
//! consumer receives for a stream of deliveries (a `basic.deliver`, a content
//! header with the properties warren's messages carry, a body of billing's
//! size), read once through a plain reader and once through the guard, in
//! turns. Prints nanoseconds per message for each and their ratio.
//!
//! `cargo bench --bench frame_guard`

#![allow(clippy::print_stdout, missing_docs)]

use std::io::IoSliceMut;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures_io::AsyncRead;
use warren::broker::guard::FrameGuard;
use warren_chaos::hostile::{Properties, Value};

const MESSAGES: usize = 200_000;
const ROUNDS: usize = 7;

/// The broker's side of the socket: hands out what it holds in reads of up
/// to 64 KiB, as a socket does under load.
struct Socket<'a> {
    data: &'a [u8],
    at: usize,
}

impl AsyncRead for Socket<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        let n = buf.len().min(64 * 1024).min(self.data.len() - self.at);
        let at = self.at;
        buf[..n].copy_from_slice(&self.data[at..at + n]);
        self.at += n;
        Poll::Ready(Ok(n))
    }
}

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![kind];
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.push(0xCE);
    out
}

/// A connection's bytes: the broker's tune, then `MESSAGES` deliveries.
fn stream() -> Vec<u8> {
    let mut tune = vec![0, 10, 0, 30, 0, 0];
    tune.extend_from_slice(&131_072u32.to_be_bytes());
    tune.extend_from_slice(&[0, 60]);
    let mut out = frame(1, 0, &tune);
    let body = vec![b'x'; 260];
    for n in 0..MESSAGES {
        let mut deliver = vec![0, 60, 0, 60, 11];
        deliver.extend_from_slice(b"consumer-1a");
        deliver.extend_from_slice(&(n as u64).to_be_bytes());
        deliver.push(0);
        deliver.push(14);
        deliver.extend_from_slice(b"billing.events");
        deliver.push(23);
        deliver.extend_from_slice(b"billing.invoice-paid.v1");
        out.extend_from_slice(&frame(1, 1, &deliver));
        let id = format!("0193a1b2-0e9b-79e6-a697-{n:012}");
        let properties = Properties::default()
            .content_type("application/json")
            .header("tenant", Value::long_string("acme"))
            .header("x-warren-attempt", Value::long(1))
            .delivery_mode(2)
            .correlation_id(&id)
            .message_id(&id)
            .timestamp(1_764_633_600)
            .kind("billing.invoice-paid.v1");
        let mut header = vec![0, 60, 0, 0];
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(&properties.encode());
        out.extend_from_slice(&frame(2, 1, &header));
        out.extend_from_slice(&frame(3, 1, &body));
    }
    out
}

/// Reads `reader` to its end as lapin does: vectored reads into a buffer of
/// 32 frames; returns the bytes read.
fn drain(mut reader: impl AsyncRead + Unpin) -> usize {
    let mut cx = Context::from_waker(Waker::noop());
    let mut buf = vec![0u8; 32 * 131_072];
    let half = buf.len() / 2;
    let mut total = 0;
    loop {
        let (a, b) = buf.split_at_mut(half);
        let mut slices = [IoSliceMut::new(a), IoSliceMut::new(b)];
        match Pin::new(&mut reader).poll_read_vectored(&mut cx, &mut slices) {
            Poll::Ready(Ok(0)) => return total,
            Poll::Ready(Ok(n)) => {
                // Read what was read, as the client does: nothing is elided.
                std::hint::black_box(&buf[..n.min(half)]);
                total += n;
            }
            other => panic!("a socket of bytes in memory never waits: {other:?}"),
        }
    }
}

fn main() {
    let data = stream();
    let mut plain = Duration::MAX;
    let mut guarded = Duration::MAX;
    for _ in 0..ROUNDS {
        let started = Instant::now();
        let n = drain(Socket { data: &data, at: 0 });
        plain = plain.min(started.elapsed());
        assert_eq!(n, data.len());
        let started = Instant::now();
        let n = drain(FrameGuard::new(Socket { data: &data, at: 0 }, 0));
        guarded = guarded.min(started.elapsed());
        assert_eq!(
            n,
            data.len(),
            "the guard passes every byte of readable frames"
        );
    }
    let per = |d: Duration| d.as_nanos() as f64 / MESSAGES as f64;
    println!(
        "{MESSAGES} deliveries ({} bytes each), best of {ROUNDS} rounds:",
        data.len() / MESSAGES
    );
    println!("  plain reader   {:8.0} ns per message", per(plain));
    println!("  frame guard    {:8.0} ns per message", per(guarded));
    println!(
        "  the guard adds {:8.0} ns per message ({:.2} times the plain read)",
        per(guarded) - per(plain),
        per(guarded) / per(plain)
    );
}
