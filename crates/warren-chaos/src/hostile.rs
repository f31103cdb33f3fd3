//! A hostile producer: publishes AMQP frames built byte by byte, with the
//! properties a client library would refuse to write or would itself crash on
//! (lapin's encoder recurses into nested tables as deep as its parser does):
//! header tables and arrays thousands of levels deep, names and ids that are
//! not UTF-8, any field type the broker takes. Point it at a queue your
//! service consumes to check that no message the broker accepts takes the
//! service down.
//!
//! ```no_run
//! # async fn demo() -> Result<(), String> {
//! use warren_chaos::hostile::{Properties, RawPublisher, Value};
//!
//! let mut producer = RawPublisher::connect("amqp://guest:guest@127.0.0.1:5672/%2f").await?;
//! let deep = Value::nested_tables(2_000, Value::long_string("leaf"));
//! let properties = Properties::default()
//!     .message_id("m-1")
//!     .content_type("application/json")
//!     .header("h", deep);
//! producer.publish("", "my.queue", &properties, b"{}").await?;
//! # Ok(()) }
//! ```
//!
//! Everything is encoded without recursion, so a test process builds values
//! as deep as one frame holds on a default stack.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long the producer waits for any one answer of the broker.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(15);

/// Bytes of framing around a frame's payload: type, channel, size, end byte.
const FRAMING: usize = 8;

/// Bytes a content header takes before its properties: class, weight, body
/// size and the property flags.
const HEADER_PREFIX: usize = 14;

/// One AMQP field value, encoded: its type tag and its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Value(Vec<u8>);

impl Value {
    /// A long string (`S`): any bytes, UTF-8 or not.
    pub fn long_string(bytes: impl AsRef<[u8]>) -> Self {
        Self::sized(b'S', bytes.as_ref())
    }

    /// A byte array (`x`).
    pub fn bytes(bytes: impl AsRef<[u8]>) -> Self {
        Self::sized(b'x', bytes.as_ref())
    }

    /// A signed 64-bit integer (`l`).
    pub fn long(v: i64) -> Self {
        Self::raw(b'l', &v.to_be_bytes())
    }

    /// A signed 32-bit integer (`I`).
    pub fn int(v: i32) -> Self {
        Self::raw(b'I', &v.to_be_bytes())
    }

    /// A boolean (`t`).
    pub fn bool(v: bool) -> Self {
        Self::raw(b't', &[u8::from(v)])
    }

    /// An unsigned byte (`B`).
    pub fn octet(v: u8) -> Self {
        Self::raw(b'B', &[v])
    }

    /// A double (`d`). RabbitMQ refuses NaN and the infinities.
    pub fn double(v: f64) -> Self {
        Self::raw(b'd', &v.to_be_bytes())
    }

    /// A timestamp (`T`), seconds.
    pub fn timestamp(v: u64) -> Self {
        Self::raw(b'T', &v.to_be_bytes())
    }

    /// A decimal (`D`): scale and unscaled value.
    pub fn decimal(scale: u8, value: u32) -> Self {
        let mut bytes = vec![scale];
        bytes.extend_from_slice(&value.to_be_bytes());
        Self::raw(b'D', &bytes)
    }

    /// No value (`V`).
    pub fn void() -> Self {
        Self::raw(b'V', &[])
    }

    /// A value of type `tag` whose bytes are `bytes`, as they are: for types
    /// and contents no helper writes.
    pub fn raw(tag: u8, bytes: &[u8]) -> Self {
        let mut out = Vec::with_capacity(1 + bytes.len());
        out.push(tag);
        out.extend_from_slice(bytes);
        Self(out)
    }

    fn sized(tag: u8, bytes: &[u8]) -> Self {
        let mut out = Vec::with_capacity(5 + bytes.len());
        out.push(tag);
        out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(bytes);
        Self(out)
    }

    /// A field table (`F`) of `entries`, in order. Names are any bytes up to
    /// 255 of them.
    pub fn table<N: AsRef<[u8]>>(entries: impl IntoIterator<Item = (N, Value)>) -> Self {
        Self::sized(b'F', &table_bytes(entries))
    }

    /// A field array (`A`) of `values`.
    pub fn array(values: impl IntoIterator<Item = Value>) -> Self {
        let mut inner = Vec::new();
        for v in values {
            inner.extend_from_slice(&v.0);
        }
        Self::sized(b'A', &inner)
    }

    /// `depth` tables, each holding the next under the name `h`, the last
    /// holding `leaf` (so the value nests `depth` tables deep).
    pub fn nested_tables(depth: usize, leaf: Value) -> Self {
        Self::nested(depth, leaf, b'F', b"\x01h")
    }

    /// `depth` arrays, each holding the next, the last holding `leaf`.
    pub fn nested_arrays(depth: usize, leaf: Value) -> Self {
        Self::nested(depth, leaf, b'A', b"")
    }

    /// Every level's tag, length and `entry` prefix, outermost first, then
    /// the leaf: written in one pass, since each level ends where the leaf does.
    fn nested(depth: usize, leaf: Value, tag: u8, entry: &[u8]) -> Self {
        let level = 5 + entry.len();
        let mut out = Vec::with_capacity(depth * level + leaf.len());
        for k in (1..=depth).rev() {
            let inner = (k - 1) * level + entry.len() + leaf.len();
            out.push(tag);
            out.extend_from_slice(&(inner as u32).to_be_bytes());
            out.extend_from_slice(entry);
        }
        out.extend(leaf.0);
        Self(out)
    }

    /// Bytes it takes in a frame, its type tag included.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never: every value has at least its type tag.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The encoded value, type tag first.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Bytes a table entry for a nested table takes per level in
/// [`Value::nested_tables`]: name length, `h`, the tag and the length.
pub const NESTED_TABLE_LEVEL: usize = 7;
/// Bytes each level of [`Value::nested_arrays`] takes: the tag and the length.
pub const NESTED_ARRAY_LEVEL: usize = 5;

fn table_bytes<N: AsRef<[u8]>>(entries: impl IntoIterator<Item = (N, Value)>) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in entries {
        let name = name.as_ref();
        out.push(name.len() as u8);
        out.extend_from_slice(name);
        out.extend_from_slice(&value.0);
    }
    out
}

/// A message's AMQP properties, each as raw bytes: UTF-8 or not, whatever
/// the broker takes. Unset properties are left out of the frame.
#[derive(Debug, Clone, Default)]
pub struct Properties {
    content_type: Option<Vec<u8>>,
    content_encoding: Option<Vec<u8>>,
    headers: Option<Vec<u8>>,
    delivery_mode: Option<u8>,
    priority: Option<u8>,
    correlation_id: Option<Vec<u8>>,
    reply_to: Option<Vec<u8>>,
    expiration: Option<Vec<u8>>,
    message_id: Option<Vec<u8>>,
    timestamp: Option<u64>,
    kind: Option<Vec<u8>>,
    user_id: Option<Vec<u8>>,
    app_id: Option<Vec<u8>>,
    cluster_id: Option<Vec<u8>>,
    reserved_flags: u16,
}

macro_rules! short_properties {
    ($($name:ident: $doc:literal),* $(,)?) => {
        $(
            #[doc = $doc]
            pub fn $name(mut self, value: impl AsRef<[u8]>) -> Self {
                self.$name = Some(value.as_ref().to_vec());
                self
            }
        )*
    };
}

impl Properties {
    short_properties!(
        content_type: "`content_type`, at most 255 bytes.",
        content_encoding: "`content_encoding`, at most 255 bytes.",
        correlation_id: "`correlation_id`, at most 255 bytes.",
        reply_to: "`reply_to`, at most 255 bytes.",
        expiration: "`expiration`, at most 255 bytes.",
        message_id: "`message_id`, at most 255 bytes.",
        kind: "`type`, at most 255 bytes.",
        user_id: "`user_id`, at most 255 bytes (the broker checks it).",
        app_id: "`app_id`, at most 255 bytes.",
        cluster_id: "`cluster_id`, at most 255 bytes.",
    );

    /// Adds the header `name` (any bytes, at most 255) with `value`, after
    /// those added before.
    pub fn header(mut self, name: impl AsRef<[u8]>, value: Value) -> Self {
        let table = self.headers.get_or_insert_with(Vec::new);
        table.extend_from_slice(&table_bytes([(name, value)]));
        self
    }

    /// An empty headers table, for headers to be added to.
    pub fn empty_headers(mut self) -> Self {
        self.headers.get_or_insert_with(Vec::new);
        self
    }

    /// `delivery_mode` (2: persistent).
    pub fn delivery_mode(mut self, mode: u8) -> Self {
        self.delivery_mode = Some(mode);
        self
    }

    /// `priority`.
    pub fn priority(mut self, priority: u8) -> Self {
        self.priority = Some(priority);
        self
    }

    /// `timestamp`, seconds.
    pub fn timestamp(mut self, seconds: u64) -> Self {
        self.timestamp = Some(seconds);
        self
    }

    /// Sets the two lowest property flag bits (`0b11` at most), which name no
    /// property: bit 0 would announce a second flag word, yet RabbitMQ and
    /// lapin read neither and take the frame as it is.
    pub fn reserved_flags(mut self, bits: u16) -> Self {
        self.reserved_flags = bits & 0b11;
        self
    }

    /// The property flags and values, as a content header carries them.
    pub fn encode(&self) -> Vec<u8> {
        let mut flags = 0u16;
        let mut out = Vec::new();
        let short = |bit: u16, v: &Option<Vec<u8>>, out: &mut Vec<u8>, flags: &mut u16| {
            if let Some(v) = v {
                *flags |= 1 << bit;
                out.push(v.len() as u8);
                out.extend_from_slice(v);
            }
        };
        short(15, &self.content_type, &mut out, &mut flags);
        short(14, &self.content_encoding, &mut out, &mut flags);
        if let Some(h) = &self.headers {
            flags |= 1 << 13;
            out.extend_from_slice(&(h.len() as u32).to_be_bytes());
            out.extend_from_slice(h);
        }
        if let Some(m) = self.delivery_mode {
            flags |= 1 << 12;
            out.push(m);
        }
        if let Some(p) = self.priority {
            flags |= 1 << 11;
            out.push(p);
        }
        short(10, &self.correlation_id, &mut out, &mut flags);
        short(9, &self.reply_to, &mut out, &mut flags);
        short(8, &self.expiration, &mut out, &mut flags);
        short(7, &self.message_id, &mut out, &mut flags);
        if let Some(t) = self.timestamp {
            flags |= 1 << 6;
            out.extend_from_slice(&t.to_be_bytes());
        }
        short(5, &self.kind, &mut out, &mut flags);
        short(4, &self.user_id, &mut out, &mut flags);
        short(3, &self.app_id, &mut out, &mut flags);
        short(2, &self.cluster_id, &mut out, &mut flags);
        let mut encoded = (flags | self.reserved_flags).to_be_bytes().to_vec();
        encoded.extend_from_slice(&out);
        encoded
    }

    /// Bytes the content header frame carrying these properties takes.
    pub fn frame_len(&self) -> usize {
        FRAMING + HEADER_PREFIX - 2 + self.encode().len()
    }
}

/// A connection that writes frames itself: one channel, in confirm mode.
pub struct RawPublisher {
    stream: TcpStream,
    frame_max: usize,
    /// Bytes read and not yet taken as a frame.
    buf: Vec<u8>,
}

/// A frame as read: type, channel, payload.
struct Frame {
    kind: u8,
    payload: Vec<u8>,
}

fn short_string(out: &mut Vec<u8>, s: &[u8]) {
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

fn method(class: u16, id: u16, args: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + args.len());
    out.extend_from_slice(&class.to_be_bytes());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(args);
    out
}

impl RawPublisher {
    /// Connects to the broker at `url` (`amqp://user:password@host:port/vhost`;
    /// plain AMQP only), opens channel 1 and puts it in confirm mode.
    pub async fn connect(url: &str) -> Result<Self, String> {
        let uri: amq_protocol_uri::AMQPUri = url.parse()?;
        let address = format!("{}:{}", uri.authority.host, uri.authority.port);
        let stream = tokio::time::timeout(ANSWER_TIMEOUT, TcpStream::connect(&address))
            .await
            .map_err(|_| format!("{address} did not accept a connection"))?
            .map_err(|e| format!("{address}: {e}"))?;
        let mut p = Self {
            stream,
            frame_max: 4096,
            buf: Vec::new(),
        };
        p.write(b"AMQP\x00\x00\x09\x01").await?;
        p.expect(10, 10, "connection.start").await?;
        let mut response = vec![0];
        response.extend_from_slice(uri.authority.userinfo.username.as_bytes());
        response.push(0);
        response.extend_from_slice(uri.authority.userinfo.password.as_bytes());
        let mut args = Vec::new();
        args.extend_from_slice(&0u32.to_be_bytes()); // empty client properties
        short_string(&mut args, b"PLAIN");
        args.extend_from_slice(&(response.len() as u32).to_be_bytes());
        args.extend_from_slice(&response);
        short_string(&mut args, b"en_US");
        p.send(1, 0, &method(10, 11, &args)).await?;
        let tune = p.expect(10, 30, "connection.tune").await?;
        let channel_max = u16::from_be_bytes([tune[4], tune[5]]);
        let frame_max = u32::from_be_bytes([tune[6], tune[7], tune[8], tune[9]]);
        let mut args = Vec::new();
        args.extend_from_slice(&channel_max.to_be_bytes());
        args.extend_from_slice(&frame_max.to_be_bytes());
        args.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        p.send(1, 0, &method(10, 31, &args)).await?;
        p.frame_max = frame_max as usize;
        let mut args = Vec::new();
        short_string(&mut args, uri.vhost.as_bytes());
        short_string(&mut args, b"");
        args.push(0);
        p.send(1, 0, &method(10, 40, &args)).await?;
        p.expect(10, 41, "connection.open-ok").await?;
        p.send(1, 1, &method(20, 10, &[0])).await?;
        p.expect(20, 11, "channel.open-ok").await?;
        p.send(1, 1, &method(85, 10, &[0])).await?;
        p.expect(85, 11, "confirm.select-ok").await?;
        Ok(p)
    }

    /// The frame size the broker negotiated: the bound for one content header.
    pub fn frame_max(&self) -> usize {
        self.frame_max
    }

    /// Publishes one message to `exchange` with `routing_key` (any bytes, at
    /// most 255 each) and waits for the broker's confirm. An error if the
    /// broker refused it: a nack, or the channel or connection closed (with
    /// the broker's words); the publisher cannot be used after a close.
    pub async fn publish(
        &mut self,
        exchange: impl AsRef<[u8]>,
        routing_key: impl AsRef<[u8]>,
        properties: &Properties,
        body: &[u8],
    ) -> Result<(), String> {
        let mut args = vec![0, 0];
        short_string(&mut args, exchange.as_ref());
        short_string(&mut args, routing_key.as_ref());
        args.push(0);
        let mut frames = frame(1, 1, &method(60, 40, &args));
        let mut header = Vec::new();
        header.extend_from_slice(&60u16.to_be_bytes());
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(&properties.encode());
        if header.len() + FRAMING > self.frame_max {
            return Err(format!(
                "the content header takes {} bytes, more than the {}-byte frame",
                header.len() + FRAMING,
                self.frame_max
            ));
        }
        frames.extend_from_slice(&frame(2, 1, &header));
        for chunk in body.chunks(self.frame_max - FRAMING) {
            frames.extend_from_slice(&frame(3, 1, chunk));
        }
        self.write(&frames).await?;
        loop {
            let f = self.read_frame().await?;
            if f.kind != 1 || f.payload.len() < 4 {
                continue;
            }
            match (&f.payload[..2], &f.payload[2..4]) {
                ([0, 60], [0, 80]) => return Ok(()),
                ([0, 60], [0, 120]) => return Err("the broker nacked the message".into()),
                ([0, 20], [0, 40]) | ([0, 10], [0, 50]) => {
                    return Err(format!("the broker closed: {}", reply_text(&f.payload)));
                }
                _ => {}
            }
        }
    }

    /// Closes the connection.
    pub async fn close(mut self) {
        let mut args = Vec::new();
        args.extend_from_slice(&200u16.to_be_bytes());
        short_string(&mut args, b"bye");
        args.extend_from_slice(&[0, 0, 0, 0]);
        if self.send(1, 0, &method(10, 50, &args)).await.is_ok() {
            let _ = tokio::time::timeout(ANSWER_TIMEOUT, async {
                while let Ok(f) = self.read_frame().await {
                    if f.kind == 1 && f.payload.get(..4) == Some(&[0, 10, 0, 51]) {
                        break;
                    }
                }
            })
            .await;
        }
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        tokio::time::timeout(ANSWER_TIMEOUT, self.stream.write_all(bytes))
            .await
            .map_err(|_| "the broker stopped reading".to_owned())?
            .map_err(|e| format!("writing to the broker: {e}"))
    }

    async fn send(&mut self, kind: u8, channel: u16, payload: &[u8]) -> Result<(), String> {
        self.write(&frame(kind, channel, payload)).await
    }

    async fn read_frame(&mut self) -> Result<Frame, String> {
        loop {
            if self.buf.len() >= 7 {
                let size = u32::from_be_bytes([self.buf[3], self.buf[4], self.buf[5], self.buf[6]])
                    as usize;
                if self.buf.len() >= size + FRAMING {
                    let payload = self.buf[7..7 + size].to_vec();
                    let kind = self.buf[0];
                    self.buf.drain(..size + FRAMING);
                    return Ok(Frame { kind, payload });
                }
            }
            let mut chunk = [0u8; 8192];
            let n = tokio::time::timeout(ANSWER_TIMEOUT, self.stream.read(&mut chunk))
                .await
                .map_err(|_| "the broker did not answer".to_owned())?
                .map_err(|e| format!("reading from the broker: {e}"))?;
            if n == 0 {
                return Err("the broker closed the connection".into());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Reads until the method `class.id` arrives; its payload.
    async fn expect(&mut self, class: u16, id: u16, what: &str) -> Result<Vec<u8>, String> {
        loop {
            let f = self.read_frame().await?;
            if f.kind != 1 || f.payload.len() < 4 {
                continue;
            }
            let got = (
                u16::from_be_bytes([f.payload[0], f.payload[1]]),
                u16::from_be_bytes([f.payload[2], f.payload[3]]),
            );
            if got == (class, id) {
                return Ok(f.payload);
            }
            if matches!(got, (10, 50) | (20, 40)) {
                return Err(format!(
                    "waiting for {what}, the broker closed: {}",
                    reply_text(&f.payload)
                ));
            }
        }
    }
}

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + FRAMING);
    out.push(kind);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.push(0xCE);
    out
}

/// The reply text of a `connection.close` or `channel.close` payload.
fn reply_text(payload: &[u8]) -> String {
    let len = payload.get(6).copied().unwrap_or(0) as usize;
    let text = payload.get(7..7 + len).unwrap_or_default();
    format!(
        "{} {}",
        u16::from_be_bytes([
            payload.get(4).copied().unwrap_or(0),
            payload.get(5).copied().unwrap_or(0)
        ]),
        String::from_utf8_lossy(text)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_values_take_the_documented_bytes_per_level() {
        let leaf = Value::void();
        // The same bytes as wrapping one level at a time.
        let (mut tables, mut arrays) = (leaf.clone(), leaf.clone());
        for depth in 1..=40 {
            tables = Value::table([("h", tables)]);
            arrays = Value::array([arrays]);
            assert_eq!(Value::nested_tables(depth, leaf.clone()), tables);
            assert_eq!(Value::nested_arrays(depth, leaf.clone()), arrays);
        }
        for depth in [0, 1, 10, 1000] {
            assert_eq!(
                Value::nested_tables(depth, leaf.clone()).len(),
                leaf.len() + depth * NESTED_TABLE_LEVEL,
                "tables {depth}"
            );
            assert_eq!(
                Value::nested_arrays(depth, leaf.clone()).len(),
                leaf.len() + depth * NESTED_ARRAY_LEVEL,
                "arrays {depth}"
            );
        }
    }

    #[test]
    fn properties_encode_in_flag_order() {
        let p = Properties::default().message_id([0xff]).content_type("a");
        // content_type (bit 15) and message_id (bit 7), in that order.
        assert_eq!(p.encode(), vec![0x80, 0x80, 1, b'a', 1, 0xff]);
    }
}
