use std::io::IoSliceMut;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_io::AsyncRead;
use warren_chaos::hostile::{Properties, Value};

use super::super::inspect::{self, tests::within_limits};
use super::{FrameGuard, HEADER, METHOD};

/// A broker that sends `data` in pieces of random size, now and then not
/// ready (and waking its reader at once).
struct Trickle {
    data: Vec<u8>,
    at: usize,
    rng: fastrand::Rng,
}

impl AsyncRead for Trickle {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.rng.u8(0..4) == 0 {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let max = self.rng.usize(1..=20_000);
        let n = buf.len().min(max).min(self.data.len() - self.at);
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

fn tune(frame_max: u32) -> Vec<u8> {
    let mut p = vec![0, 10, 0, 30, 0, 0];
    p.extend_from_slice(&frame_max.to_be_bytes());
    p.extend_from_slice(&[0, 60]);
    p
}

fn deliver(routing_key: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 60, 0, 60, 1, b'c'];
    out.extend_from_slice(&1u64.to_be_bytes());
    out.push(0);
    out.push(2);
    out.extend_from_slice(b"ex");
    out.push(routing_key.len() as u8);
    out.extend_from_slice(routing_key);
    out
}

fn header(p: &Properties, body: usize) -> Vec<u8> {
    let mut out = vec![0, 60, 0, 0];
    out.extend_from_slice(&(body as u64).to_be_bytes());
    out.extend_from_slice(&p.encode());
    out
}

/// Parses `stream` frame by frame with lapin's own parser: every frame reads,
/// none is past `frame_max` after the tune, every message's properties are
/// within the guard's limits. Returns the content headers' properties.
fn read_as_lapin(stream: &[u8], frame_max: usize) -> Vec<lapin::BasicProperties> {
    use amq_protocol::frame::{AMQPFrame, parse_frame};
    let mut rest = stream;
    let mut found = Vec::new();
    while !rest.is_empty() {
        let (after, frame) = parse_frame(rest).expect("lapin reads every frame");
        assert!(
            rest.len() - after.len() <= frame_max,
            "a frame past frame_max"
        );
        if let AMQPFrame::Header(_, header) = frame {
            assert!(within_limits(&header.properties));
            found.push(header.properties);
        }
        rest = after;
    }
    found
}

/// Reads everything through a guard, in reads of random size, half of them
/// vectored into two buffers as lapin reads.
async fn through_guard(data: Vec<u8>, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut guard = FrameGuard::new(
        Trickle {
            data,
            at: 0,
            rng: rng.fork(),
        },
        0,
    );
    let mut out = Vec::new();
    loop {
        let (a, b) = (rng.usize(1..5000), rng.usize(0..5000));
        let mut first = vec![0u8; a];
        let mut second = vec![0u8; b];
        let vectored = rng.bool();
        let n = std::future::poll_fn(|cx| {
            let g = Pin::new(&mut guard);
            if vectored {
                g.poll_read_vectored(
                    cx,
                    &mut [IoSliceMut::new(&mut first), IoSliceMut::new(&mut second)],
                )
            } else {
                g.poll_read(cx, &mut first)
            }
        })
        .await
        .unwrap();
        if n == 0 {
            return out;
        }
        let from_first = n.min(a);
        out.extend_from_slice(&first[..from_first]);
        out.extend_from_slice(&second[..n - from_first]);
    }
}

#[tokio::test]
async fn frames_pass_whole_and_in_order_and_only_unreadable_ones_change() {
    const FRAME_MAX: usize = 131_072;
    let good = Properties::default()
        .message_id("m1")
        .header("a", Value::long(1));
    let deep = Properties::default()
        .message_id("m2")
        .header("h", Value::nested_tables(15_000, Value::void()));
    let body = vec![7u8; 300_000];
    // (the frame, what the client must receive instead, if anything)
    let mut plan: Vec<(Vec<u8>, Option<Vec<u8>>)> = vec![
        (frame(METHOD, 0, &tune(FRAME_MAX as u32)), None),
        (frame(8, 0, &[]), None),
    ];
    // A delivery whose routing key is not UTF-8, on channel 1.
    let mut fixed = deliver(&[b'k', 0xff]);
    let carried = inspect::method(&mut fixed);
    plan.push((
        frame(METHOD, 1, &deliver(&[b'k', 0xff])),
        Some(frame(METHOD, 1, &fixed)),
    ));
    let reported = inspect::content_header(&header(&good, 3), carried, FRAME_MAX).unwrap();
    plan.push((
        frame(HEADER, 1, &header(&good, 3)),
        Some(frame(HEADER, 1, &reported)),
    ));
    plan.push((frame(3, 1, b"abc"), None));
    // A good delivery on channel 2 between, then a deep one, its body in frames.
    plan.push((frame(METHOD, 2, &deliver(b"k")), None));
    plan.push((frame(HEADER, 2, &header(&good, 0)), None));
    plan.push((frame(METHOD, 2, &deliver(b"k")), None));
    let pruned = inspect::content_header(&header(&deep, body.len()), None, FRAME_MAX).unwrap();
    plan.push((
        frame(HEADER, 2, &header(&deep, body.len())),
        Some(frame(HEADER, 2, &pruned)),
    ));
    for chunk in body.chunks(FRAME_MAX - 8) {
        plan.push((frame(3, 2, chunk), None));
    }
    plan.push((frame(8, 0, &[]), None));
    let sent: Vec<u8> = plan.iter().flat_map(|(f, _)| f.clone()).collect();
    let expected: Vec<u8> = plan
        .iter()
        .flat_map(|(f, instead)| instead.clone().unwrap_or_else(|| f.clone()))
        .collect();
    for seed in 0..20 {
        assert!(
            through_guard(sent.clone(), seed).await == expected,
            "seed {seed}: the client reads the planned frames"
        );
    }
    // And, read as lapin reads it: the bad routing key's delivery and the deep
    // one carry the report; the others arrive as they were sent.
    let mut headers = read_as_lapin(&expected, FRAME_MAX).into_iter();
    let mut reported = |expect: Option<super::super::Cause>| {
        let mut p = headers.next().unwrap();
        assert_eq!(super::super::take_pruned(&mut p).map(|r| r.cause), expect);
        p
    };
    reported(Some(super::super::Cause::Unreadable));
    reported(None);
    let deep = reported(Some(super::super::Cause::TooDeep));
    assert!(!deep.headers().as_ref().unwrap().contains_key("h"));
}

#[tokio::test]
async fn a_refusal_and_a_stream_cut_short_pass_as_they_came() {
    // The broker's answer to a protocol version it does not speak.
    let refusal = b"AMQP\x00\x00\x09\x01".to_vec();
    assert_eq!(through_guard(refusal.clone(), 1).await, refusal);
    // A content header cut off mid-frame: the client gets the bytes and the end.
    let mut cut = frame(METHOD, 0, &tune(131_072));
    let deep = Properties::default().header("h", Value::nested_arrays(5_000, Value::void()));
    cut.extend_from_slice(&frame(HEADER, 1, &header(&deep, 0))[..9_000]);
    assert_eq!(through_guard(cut.clone(), 2).await, cut);
}

#[tokio::test]
async fn a_content_header_too_large_to_read_is_replaced_and_its_body_passes() {
    const FRAME_MAX: usize = 131_072;
    let huge = Properties::default()
        .message_id("m")
        .header("h", Value::long_string(vec![b'x'; 5 * FRAME_MAX]));
    let original = header(&huge, 3);
    let mut prefix = [0u8; 12];
    prefix.copy_from_slice(&original[..12]);
    let sent: Vec<u8> = [
        frame(METHOD, 0, &tune(FRAME_MAX as u32)),
        frame(HEADER, 1, &original),
        frame(3, 1, b"abc"),
        frame(8, 0, &[]),
    ]
    .concat();
    let expected: Vec<u8> = [
        frame(METHOD, 0, &tune(FRAME_MAX as u32)),
        frame(
            HEADER,
            1,
            &inspect::unread(&prefix, original.len() + 8, None),
        ),
        frame(3, 1, b"abc"),
        frame(8, 0, &[]),
    ]
    .concat();
    for seed in 0..5 {
        assert!(
            through_guard(sent.clone(), seed).await == expected,
            "seed {seed}"
        );
    }
    assert_eq!(read_as_lapin(&expected, FRAME_MAX).len(), 1);
    let replaced = inspect::unread(&prefix, original.len() + 8, None);
    let (_, mut read) = lapin::protocol::basic::parse_properties(&replaced[12..]).unwrap();
    let pruned = super::super::take_pruned(&mut read).unwrap();
    assert_eq!(pruned.cause, super::super::Cause::Unreadable);
    assert!(pruned.detail.contains("were not read"), "{}", pruned.detail);
}
