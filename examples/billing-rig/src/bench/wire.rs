//! Counting what crosses the wire: a pass-through proxy in front of the broker
//! or the database that reads the protocol's framing as the bytes go by and
//! counts what the client sent. It changes nothing and decides nothing; the
//! counts are what the benchmark's gates on statements and ack frames read, so
//! that they come from the wire, not from warren's own bookkeeping.
//!
//! - **PostgreSQL** (frontend protocol 3, no TLS): every simple `Query` and
//!   every `Sync` is a round trip (the server answers each with
//!   `ReadyForQuery`); every statement in a simple query and every `Execute`
//!   is a statement, named by its SQL (from the `Parse` that prepared it); a
//!   `Sync` with nothing before it is a ping, which sqlx's pool sends when it
//!   hands a connection out and when it takes one back.
//! - **AMQP 0-9-1**: every method frame the client sent, by method, and the
//!   `basic.deliver` frames the broker sent.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a proxy speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Postgres,
    Amqp,
}

/// What the clients of one proxy sent, counted.
#[derive(Debug, Default, Clone)]
pub(crate) struct Counts {
    /// Round trips: simple queries and syncs (PostgreSQL).
    pub round_trips: u64,
    /// Syncs with no statement before them: sqlx's pings (PostgreSQL).
    pub pings: u64,
    /// Statements prepared under a name (PostgreSQL): sqlx prepares each
    /// statement once per connection, a round trip of its own, then keeps it.
    pub prepares: u64,
    /// Statements run, by their SQL with whitespace collapsed (PostgreSQL).
    pub statements: BTreeMap<String, u64>,
    /// Method frames the client sent, by name (AMQP).
    pub methods: BTreeMap<&'static str, u64>,
    /// `basic.deliver` frames the broker sent (AMQP).
    pub deliveries: u64,
}

impl Counts {
    /// Statements whose SQL starts with `head` (case-insensitive).
    pub(crate) fn statements_starting(&self, head: &str) -> u64 {
        let head = head.to_ascii_uppercase();
        self.statements
            .iter()
            .filter(|(sql, _)| sql.to_ascii_uppercase().starts_with(&head))
            .map(|(_, n)| n)
            .sum()
    }

    /// Every statement run.
    pub(crate) fn all_statements(&self) -> u64 {
        self.statements.values().sum()
    }

    /// Method frames named `name` (`basic.ack`...).
    pub(crate) fn method(&self, name: &str) -> u64 {
        self.methods.get(name).copied().unwrap_or(0)
    }
}

/// A running proxy: where clients connect, and what they sent so far.
pub(crate) struct Proxy {
    pub addr: SocketAddr,
    counts: Arc<Mutex<Counts>>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free loopback port and forwards every connection to
    /// `upstream`, counting as `protocol`.
    pub(crate) async fn start(protocol: Protocol, upstream: SocketAddr) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("counting proxy: {e}"))?;
        let addr = listener.local_addr().map_err(|e| e.to_string())?;
        let counts = Arc::new(Mutex::new(Counts::default()));
        let shared = Arc::clone(&counts);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let counts = Arc::clone(&shared);
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        relay(protocol, client, server, counts).await;
                    }
                });
            }
        });
        Ok(Self { addr, counts, task })
    }

    /// The counts so far.
    pub(crate) fn counts(&self) -> Counts {
        lock(&self.counts).clone()
    }

    /// Forgets what was counted so far.
    pub(crate) fn reset(&self) {
        *lock(&self.counts) = Counts::default();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock(counts: &Mutex<Counts>) -> std::sync::MutexGuard<'_, Counts> {
    counts
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Copies both ways until either side closes, reading each direction's frames.
async fn relay(
    protocol: Protocol,
    client: TcpStream,
    server: TcpStream,
    counts: Arc<Mutex<Counts>>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let up_counts = Arc::clone(&counts);
    let up = async move {
        let mut reader = Reader::new(protocol, Direction::FromClient);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            reader.feed(&buf[..n], &up_counts);
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let down = async move {
        let mut reader = Reader::new(protocol, Direction::FromServer);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            reader.feed(&buf[..n], &counts);
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(up, down);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    FromClient,
    FromServer,
}

/// One direction of one connection: bytes in, frames counted.
struct Reader {
    protocol: Protocol,
    direction: Direction,
    pending: Vec<u8>,
    /// Bytes still to skip before the framing starts (the AMQP protocol
    /// header), or the untyped first message (PostgreSQL's startup).
    started: bool,
    /// The stream cannot be read any more (TLS, or bytes that do not parse).
    opaque: bool,
    /// PostgreSQL: prepared statements of this connection by name, and the
    /// statement the last `Bind` bound.
    prepared: HashMap<String, String>,
    bound: Option<String>,
    /// PostgreSQL: something other than a sync since the last sync.
    busy: bool,
}

impl Reader {
    fn new(protocol: Protocol, direction: Direction) -> Self {
        Self {
            protocol,
            direction,
            pending: Vec::new(),
            started: false,
            opaque: false,
            prepared: HashMap::new(),
            bound: None,
            busy: false,
        }
    }

    fn feed(&mut self, bytes: &[u8], counts: &Mutex<Counts>) {
        if self.opaque {
            return;
        }
        self.pending.extend_from_slice(bytes);
        let mut counted = Counts::default();
        let used = match self.protocol {
            Protocol::Postgres => self.postgres(&mut counted),
            Protocol::Amqp => self.amqp(&mut counted),
        };
        self.pending.drain(..used);
        let mut counts = lock(counts);
        counts.round_trips += counted.round_trips;
        counts.pings += counted.pings;
        counts.prepares += counted.prepares;
        counts.deliveries += counted.deliveries;
        for (sql, n) in counted.statements {
            *counts.statements.entry(sql).or_default() += n;
        }
        for (method, n) in counted.methods {
            *counts.methods.entry(method).or_default() += n;
        }
    }

    /// Reads whole PostgreSQL messages from `pending`; returns the bytes used.
    fn postgres(&mut self, counted: &mut Counts) -> usize {
        let mut at = 0;
        let buf = std::mem::take(&mut self.pending);
        if self.direction == Direction::FromServer {
            self.pending = buf;
            return 0;
        }
        if !self.started {
            // StartupMessage or SSLRequest: a length, no type byte.
            let Some(len) = be_u32(&buf, 0) else {
                self.pending = buf;
                return 0;
            };
            let len = len as usize;
            if buf.len() < len {
                self.pending = buf;
                return 0;
            }
            if be_u32(&buf, 4) == Some(80_877_103) {
                // SSLRequest: what follows may be TLS.
                self.opaque = true;
                self.pending = buf;
                return 0;
            }
            self.started = true;
            at = len;
        }
        while let (Some(&kind), Some(len)) = (buf.get(at), be_u32(&buf, at + 1)) {
            let end = at + 1 + len as usize;
            if buf.len() < end {
                break;
            }
            let body = &buf[at + 5..end];
            match kind {
                b'Q' => {
                    counted.round_trips += 1;
                    for statement in cstr(body).split(';') {
                        let sql = collapse(statement);
                        if !sql.is_empty() {
                            *counted.statements.entry(sql).or_default() += 1;
                        }
                    }
                    self.busy = false;
                }
                b'P' => {
                    let name = cstr(body).to_owned();
                    if !name.is_empty() {
                        counted.prepares += 1;
                    }
                    let sql = cstr(&body[name.len() + 1..]);
                    self.prepared.insert(name.clone(), collapse(sql));
                    if name.is_empty() {
                        // An unnamed statement is bound right after.
                        self.bound = Some(collapse(sql));
                    }
                    self.busy = true;
                }
                b'B' => {
                    let portal = cstr(body);
                    let statement = cstr(&body[portal.len() + 1..]);
                    self.bound = self.prepared.get(statement).cloned();
                    self.busy = true;
                }
                b'E' => {
                    let sql = self.bound.clone().unwrap_or_else(|| "(unknown)".into());
                    *counted.statements.entry(sql).or_default() += 1;
                    self.busy = true;
                }
                b'S' => {
                    counted.round_trips += 1;
                    if !self.busy {
                        counted.pings += 1;
                    }
                    self.busy = false;
                }
                _ => self.busy = true,
            }
            at = end;
        }
        self.pending = buf;
        at
    }

    /// Reads whole AMQP frames from `pending`; returns the bytes used.
    fn amqp(&mut self, counted: &mut Counts) -> usize {
        let mut at = 0;
        if !self.started && self.direction == Direction::FromClient {
            if self.pending.len() < 8 {
                return 0;
            }
            if &self.pending[..4] != b"AMQP" {
                self.opaque = true;
                return 0;
            }
            self.started = true;
            at = 8;
        }
        while let (Some(&kind), Some(size)) = (self.pending.get(at), be_u32(&self.pending, at + 3))
        {
            let end = at + 7 + size as usize + 1;
            if self.pending.len() < end {
                break;
            }
            if kind == 1 && size >= 4 {
                let class = be_u16(&self.pending, at + 7).unwrap_or(0);
                let method = be_u16(&self.pending, at + 9).unwrap_or(0);
                let name = method_name(class, method);
                match self.direction {
                    Direction::FromClient => *counted.methods.entry(name).or_default() += 1,
                    Direction::FromServer if name == "basic.deliver" => counted.deliveries += 1,
                    Direction::FromServer => {}
                }
            }
            at = end;
        }
        at
    }
}

fn be_u32(buf: &[u8], at: usize) -> Option<u32> {
    buf.get(at..at + 4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

fn be_u16(buf: &[u8], at: usize) -> Option<u16> {
    buf.get(at..at + 2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
}

/// The NUL-terminated string at the start of `bytes`.
fn cstr(bytes: &[u8]) -> &str {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    std::str::from_utf8(&bytes[..end]).unwrap_or("")
}

/// `sql` with runs of whitespace made one space.
fn collapse(sql: &str) -> String {
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The AMQP methods the benchmark reads, by class and method id.
fn method_name(class: u16, method: u16) -> &'static str {
    match (class, method) {
        (60, 40) => "basic.publish",
        (60, 60) => "basic.deliver",
        (60, 80) => "basic.ack",
        (60, 90) => "basic.reject",
        (60, 120) => "basic.nack",
        (60, 10) => "basic.qos",
        (60, 20) => "basic.consume",
        (60, 30) => "basic.cancel",
        (85, 10) => "confirm.select",
        (20, _) => "channel.*",
        (10, _) => "connection.*",
        (40, _) => "exchange.*",
        (50, _) => "queue.*",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg_message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn postgres_statements_round_trips_and_pings_are_counted() {
        let counts = Mutex::new(Counts::default());
        let mut reader = Reader::new(Protocol::Postgres, Direction::FromClient);
        let mut startup = 8u32.to_be_bytes().to_vec();
        startup.extend_from_slice(&196_608u32.to_be_bytes());
        let mut bytes = startup;
        bytes.extend(pg_message(b'Q', b"BEGIN; SET LOCAL lock_timeout = 25\0"));
        bytes.extend(pg_message(b'P', b"s1\0INSERT  INTO t\n VALUES ($1)\0\0\0"));
        bytes.extend(pg_message(b'B', b"\0s1\0\0\0\0\0\0\0"));
        bytes.extend(pg_message(b'E', b"\0\0\0\0\0"));
        bytes.extend(pg_message(b'S', b""));
        bytes.extend(pg_message(b'S', b""));
        // Fed in two pieces, split inside a message.
        reader.feed(&bytes[..20], &counts);
        reader.feed(&bytes[20..], &counts);
        let c = lock(&counts).clone();
        assert_eq!(c.round_trips, 3);
        assert_eq!(c.pings, 1);
        assert_eq!(c.prepares, 1);
        assert_eq!(c.statements_starting("BEGIN"), 1);
        assert_eq!(c.statements_starting("SET LOCAL"), 1);
        assert_eq!(c.statements_starting("INSERT INTO t VALUES"), 1);
        assert_eq!(c.all_statements(), 3);
    }

    #[test]
    fn amqp_acks_and_deliveries_are_counted() {
        let frame = |class: u16, method: u16| {
            let mut f = vec![1, 0, 1];
            f.extend_from_slice(&13u32.to_be_bytes());
            f.extend_from_slice(&class.to_be_bytes());
            f.extend_from_slice(&method.to_be_bytes());
            f.extend_from_slice(&[0; 9]);
            f.push(0xCE);
            f
        };
        let counts = Mutex::new(Counts::default());
        let mut client = Reader::new(Protocol::Amqp, Direction::FromClient);
        let mut bytes = b"AMQP\0\0\x09\x01".to_vec();
        bytes.extend(frame(60, 80));
        bytes.extend(frame(60, 80));
        bytes.extend(frame(60, 120));
        client.feed(&bytes, &counts);
        let mut server = Reader::new(Protocol::Amqp, Direction::FromServer);
        let delivers: Vec<u8> = (0..3).flat_map(|_| frame(60, 60)).collect();
        server.feed(&delivers[..10], &counts);
        server.feed(&delivers[10..], &counts);
        let c = lock(&counts).clone();
        assert_eq!(c.method("basic.ack"), 2);
        assert_eq!(c.method("basic.nack"), 1);
        assert_eq!(c.deliveries, 3);
    }
}
