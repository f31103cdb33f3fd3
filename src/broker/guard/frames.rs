//! The guard in the byte stream: between the socket (or TLS) and the AMQP
//! client, it cuts what the broker sends into frames and hands each one on as
//! it came, or rewritten where the client could not read it safely. Writes
//! pass through untouched.

use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_io::{AsyncRead, AsyncWrite};

use super::inspect::{self, Carried};

/// Frame type of a method frame.
const METHOD: u8 = 1;
/// Frame type of a content header frame: a message's properties.
const HEADER: u8 = 2;
/// Bytes before a frame's payload (type, channel, size) and after it (end).
const FRAMING: usize = 8;
/// The smallest frame AMQP lets a peer negotiate.
const FRAME_MIN_SIZE: usize = 4096;
/// What one read from the socket asks for.
const READ_CHUNK: usize = 64 * 1024;
/// A content header up to this many times the negotiated frame size is read
/// whole (the broker sends one past the size when it adds headers to a
/// redelivery); a larger one is not read at all but replaced.
pub(super) const UNREAD_PAST: usize = 4;

/// Where the guard is in the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    /// Nothing read yet: the broker may answer with a protocol header instead
    /// of a frame, when it refuses the client's version.
    Start,
    /// At the start of a frame.
    Frame,
    /// Inside a frame that passes through as it comes (a body, a heartbeat):
    /// this many bytes of it are still to come.
    Passing(usize),
    /// Inside a content header too large to read: this many bytes of it are
    /// still to be dropped (a report stands in for it).
    Dropping(usize),
    /// Not AMQP frames (a refusal's protocol header): everything passes.
    Raw,
}

/// A byte stream from the broker, cut into frames and inspected: what the
/// AMQP client reads through it is what the broker sent, but for the message
/// properties the client cannot read safely, rewritten (see the [module
/// documentation](super)). Every connection [`connect`](crate::broker::connect)
/// opens reads through one; wrap the stream of a lapin connection you make
/// yourself (`lapin::Connection::connector`) the same way. Writes pass
/// through untouched.
pub struct FrameGuard<S> {
    inner: S,
    /// Bytes read: `[start..ready]` may go to the client, `[ready..end]` wait
    /// for the rest of their frame.
    buf: Vec<u8>,
    start: usize,
    ready: usize,
    end: usize,
    at: At,
    eof: bool,
    /// The frame size the client asks for (0: whatever the broker offers).
    client_frame_max: usize,
    /// The negotiated frame size, once the broker's `connection.tune` passed.
    frame_max: usize,
    /// Per channel: what a `basic.deliver`, `basic.get-ok` or `basic.return`
    /// had to make UTF-8, for the content header that follows it.
    carried: HashMap<u16, Carried>,
}

impl<S> FrameGuard<S> {
    /// Guards `inner`, the bytes of one connection from its first: the
    /// broker's `connection.tune` tells the guard the frame size.
    /// `client_frame_max` is the frame size the client asks for in its
    /// `connection.tune-ok` (the `frame_max` of its URL; 0 for the broker's).
    pub fn new(inner: S, client_frame_max: u32) -> Self {
        Self {
            inner,
            buf: vec![0; 2 * READ_CHUNK],
            start: 0,
            ready: 0,
            end: 0,
            at: At::Start,
            eof: false,
            client_frame_max: client_frame_max as usize,
            // Until tuned: the largest frame the broker may send before it.
            frame_max: u32::MAX as usize,
            carried: HashMap::new(),
        }
    }

    /// Moves `ready` over every complete frame in `[ready..end]`, inspecting
    /// (and where needed rewriting) the ones the client parses into values.
    fn advance(&mut self) {
        loop {
            let available = self.end - self.ready;
            match self.at {
                At::Raw => {
                    self.ready = self.end;
                    return;
                }
                At::Start => {
                    if available == 0 {
                        return;
                    }
                    self.at = if self.buf[self.ready] == b'A' {
                        At::Raw
                    } else {
                        At::Frame
                    };
                }
                At::Passing(left) => {
                    let n = left.min(available);
                    self.ready += n;
                    if n < left {
                        self.at = At::Passing(left - n);
                        return;
                    }
                    self.at = At::Frame;
                }
                At::Dropping(left) => {
                    let n = left.min(available);
                    self.buf.copy_within(self.ready + n..self.end, self.ready);
                    self.end -= n;
                    if n < left {
                        self.at = At::Dropping(left - n);
                        return;
                    }
                    self.at = At::Frame;
                }
                At::Frame => {
                    if available < 7 {
                        return;
                    }
                    let head = &self.buf[self.ready..self.ready + 7];
                    let kind = head[0];
                    let channel = u16::from_be_bytes([head[1], head[2]]);
                    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
                    let whole = size + FRAMING;
                    let read_whole = match kind {
                        HEADER => self.frame_max.saturating_mul(UNREAD_PAST),
                        // A method frame past the negotiated size is the
                        // client's to refuse; none carries a message's text.
                        METHOD => self.frame_max,
                        _ => 0,
                    };
                    if whole <= read_whole {
                        if available < whole {
                            return;
                        }
                        self.inspect(kind, channel, whole);
                    } else if kind == HEADER {
                        if available < 7 + 12 {
                            return;
                        }
                        self.replace_unread(channel, whole);
                    } else {
                        self.at = At::Passing(whole);
                    }
                }
            }
        }
    }

    /// Inspects the complete frame at `ready`, `whole` bytes long, and moves
    /// `ready` past it (or past what replaced it).
    fn inspect(&mut self, kind: u8, channel: u16, whole: usize) {
        let payload = self.ready + 7..self.ready + whole - 1;
        if kind == METHOD {
            if channel == 0 {
                self.tune(payload.clone());
            }
            if let Some(carried) = inspect::method(&mut self.buf[payload]) {
                self.carried.insert(channel, carried);
            }
            self.ready += whole;
            return;
        }
        // Nearly always empty: skip the hashing then.
        let carried = (!self.carried.is_empty())
            .then(|| self.carried.remove(&channel))
            .flatten();
        let Some(rewritten) = inspect::content_header(&self.buf[payload], carried, self.frame_max)
        else {
            self.ready += whole;
            return;
        };
        self.put_header(channel, &rewritten, whole);
    }

    /// Puts a content header frame with `payload` on `channel` in place of
    /// the first `replacing` bytes at `ready`, and moves `ready` past it.
    fn put_header(&mut self, channel: u16, payload: &[u8], replacing: usize) {
        let mut frame = Vec::with_capacity(payload.len() + FRAMING);
        frame.push(HEADER);
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(0xCE);
        self.splice(self.ready..self.ready + replacing, &frame);
        self.ready += frame.len();
    }

    /// Puts a report in place of the content header at `ready`, `whole`
    /// bytes long, too large to read: only its class and body size are kept
    /// (so the body frames that follow still make up the message), and the
    /// rest of it is dropped as it arrives.
    fn replace_unread(&mut self, channel: u16, whole: usize) {
        let mut prefix = [0u8; 12];
        prefix.copy_from_slice(&self.buf[self.ready + 7..self.ready + 19]);
        let carried = self.carried.remove(&channel);
        let payload = inspect::unread(&prefix, whole, carried);
        self.put_header(channel, &payload, 19);
        self.at = At::Dropping(whole - 19);
    }

    /// Reads the negotiated frame size off the broker's `connection.tune`.
    fn tune(&mut self, payload: std::ops::Range<usize>) {
        let p = &self.buf[payload];
        if p.len() >= 10 && p[..4] == [0, 10, 0, 30] {
            let offered = u32::from_be_bytes([p[6], p[7], p[8], p[9]]) as usize;
            let negotiated = match (offered, self.client_frame_max) {
                (0, 0) => u32::MAX as usize,
                (0, client) => client,
                (broker, 0) => broker,
                (broker, client) => broker.min(client),
            };
            self.frame_max = negotiated.max(FRAME_MIN_SIZE);
        }
    }

    /// Replaces `range` of the buffer with `with`, moving what follows.
    fn splice(&mut self, range: std::ops::Range<usize>, with: &[u8]) {
        let grow = with.len().saturating_sub(range.len());
        if self.end + grow > self.buf.len() {
            self.buf.resize(self.end + grow, 0);
        }
        let tail = range.end..self.end;
        let to = range.start + with.len();
        self.buf.copy_within(tail.clone(), to);
        self.buf[range.start..to].copy_from_slice(with);
        self.end = to + tail.len();
    }

    /// Makes room to read into: what was handed on is dropped from the front,
    /// and the buffer grows when one frame needs more than it holds.
    fn make_room(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.ready -= self.start;
            self.end -= self.start;
            self.start = 0;
        }
        if self.buf.len() - self.end < READ_CHUNK / 4 {
            let len = self.buf.len();
            self.buf.resize(len + len.max(READ_CHUNK), 0);
        }
    }

    /// Copies ready bytes into `out`; how many.
    fn hand_on(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.ready - self.start);
        out[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.ready = 0;
            self.end = 0;
        }
        n
    }
}

impl<S: AsyncRead + Unpin> FrameGuard<S> {
    /// Reads until some bytes are ready to hand on, or the stream ended, or
    /// the socket has nothing more now (then its waker is registered).
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.start == self.ready {
            if self.eof {
                // A frame cut short by the end of the stream goes on as it is:
                // the client reports it.
                self.ready = self.end;
                return Poll::Ready(Ok(()));
            }
            if self.buf.len() - self.end < READ_CHUNK / 4 || self.start > 0 {
                self.make_room();
            }
            let end = self.end;
            let n = match Pin::new(&mut self.inner).poll_read(cx, &mut self.buf[end..]) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(n)) => n,
            };
            if n == 0 {
                self.eof = true;
            } else {
                self.end += n;
                self.advance();
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FrameGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        if out.is_empty() {
            return Poll::Ready(Ok(0));
        }
        match self.poll_fill(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Ok(self.hand_on(out))),
            other => other.map_ok(|()| 0),
        }
    }

    fn poll_read_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
    ) -> Poll<io::Result<usize>> {
        if bufs.iter().all(|b| b.is_empty()) {
            return Poll::Ready(Ok(0));
        }
        match self.poll_fill(cx) {
            Poll::Ready(Ok(())) => {
                let mut total = 0;
                for buf in bufs {
                    let n = self.hand_on(buf);
                    total += n;
                    if n < buf.len() {
                        break;
                    }
                }
                Poll::Ready(Ok(total))
            }
            other => other.map_ok(|()| 0),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FrameGuard<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_close(cx)
    }
}

#[cfg(test)]
#[path = "frames_tests.rs"]
mod tests;
