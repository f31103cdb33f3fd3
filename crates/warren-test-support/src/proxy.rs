//! A TCP proxy in front of the broker, to fault one client (take its broker
//! down, or freeze it) without touching the broker the other tests share.

use tokio::task::JoinHandle;

use crate::amqp_url;

/// A TCP proxy in front of the broker (the one `AMQP_URL` names) that can be
/// taken down and brought back, or frozen (connections stay open and nothing
/// passes, like a broker that stopped answering), to fault one client without
/// touching the shared broker.
pub struct Proxy {
    /// The local port the proxy listens on.
    pub port: u16,
    state: tokio::sync::watch::Sender<ProxyState>,
    task: JoinHandle<()>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProxyMode {
    Up,
    Down,
    Frozen,
}

/// What new connections get (`mode`), and how many times the proxy was taken
/// down and frozen. A watch shows only its latest value, so a down and a freeze
/// in quick succession could not be told apart as signals; as counters that only
/// grow, a connection compares them with their values when it opened and sees
/// every fault that happened since, whatever it missed in between.
#[derive(Debug, Clone, Copy)]
struct ProxyState {
    mode: ProxyMode,
    downs: u64,
    freezes: u64,
}

/// A fault that reached one connection.
enum Fault {
    Down,
    Frozen,
}

/// Waits for the next fault since `opened`: a down wins over a freeze. The
/// proxy going away counts as down.
async fn next_fault(
    state: &mut tokio::sync::watch::Receiver<ProxyState>,
    opened: ProxyState,
) -> Fault {
    loop {
        let now = *state.borrow_and_update();
        if now.downs > opened.downs {
            return Fault::Down;
        }
        if now.freezes > opened.freezes {
            return Fault::Frozen;
        }
        if state.changed().await.is_err() {
            return Fault::Down;
        }
    }
}

/// Waits until the proxy is taken down after `opened` (or goes away).
async fn next_down(state: &mut tokio::sync::watch::Receiver<ProxyState>, opened: ProxyState) {
    while state.borrow_and_update().downs <= opened.downs {
        if state.changed().await.is_err() {
            return;
        }
    }
}

/// The broker's `host:port`, from `AMQP_URL`.
fn broker_address() -> String {
    let url = url::Url::parse(&amqp_url()).expect("AMQP_URL is a URL");
    let host = url.host_str().unwrap_or("127.0.0.1");
    let port = url
        .port()
        .unwrap_or(if url.scheme() == "amqps" { 5671 } else { 5672 });
    format!("{host}:{port}")
}

impl Proxy {
    /// Starts a proxy, passing traffic, on a free local port.
    pub async fn start() -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let upstream = broker_address();
        let (state, _) = tokio::sync::watch::channel(ProxyState {
            mode: ProxyMode::Up,
            downs: 0,
            freezes: 0,
        });
        let state2 = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    continue;
                };
                let mut watch = state2.subscribe();
                let opened = *watch.borrow_and_update();
                let upstream = upstream.clone();
                match opened.mode {
                    ProxyMode::Down => drop(client), // refused, as a stopped broker would
                    ProxyMode::Frozen => {
                        // Accepted and never answered, until the proxy goes down.
                        tokio::spawn(async move {
                            next_down(&mut watch, opened).await;
                            drop(client);
                        });
                    }
                    ProxyMode::Up => {
                        tokio::spawn(async move {
                            let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await
                            else {
                                return;
                            };
                            let fault = tokio::select! {
                                _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
                                fault = next_fault(&mut watch, opened) => fault,
                            };
                            if let Fault::Frozen = fault {
                                // Both ends stay open and nothing passes.
                                next_down(&mut watch, opened).await;
                            }
                        });
                    }
                }
            }
        });
        Proxy { port, state, task }
    }

    /// `AMQP_URL` with the proxy in place of the broker.
    pub fn url(&self) -> String {
        let mut url = url::Url::parse(&amqp_url()).expect("AMQP_URL is a URL");
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(self.port)).unwrap();
        url.into()
    }

    /// Cuts every connection and refuses new ones.
    pub fn down(&self) {
        self.state.send_modify(|s| {
            s.mode = ProxyMode::Down;
            s.downs += 1;
        });
    }

    /// Stops passing bytes on every connection without closing any, and accepts
    /// new ones without ever answering.
    pub fn freeze(&self) {
        self.state.send_modify(|s| {
            s.mode = ProxyMode::Frozen;
            s.freezes += 1;
        });
    }

    /// Accepts and forwards new connections again.
    pub fn up(&self) {
        self.state.send_modify(|s| s.mode = ProxyMode::Up);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.down();
        self.task.abort();
    }
}

#[cfg(test)]
mod proxy_tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Regression (issue 10): `down()` sent two watch signals in a row to close
    /// frozen connections, and a watch may deliver them as one, which left those
    /// connections frozen instead of closed. A freeze followed at once by a down
    /// now closes every connection, frozen or not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn down_right_after_freeze_closes_connections() {
        for _ in 0..20 {
            let proxy = Proxy::start().await;
            let mut open = tokio::net::TcpStream::connect(("127.0.0.1", proxy.port))
                .await
                .unwrap();
            // The AMQP header: the broker answers with connection.start.
            open.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
            let mut buf = [0u8; 7];
            open.read_exact(&mut buf).await.unwrap();
            proxy.freeze();
            let mut frozen = tokio::net::TcpStream::connect(("127.0.0.1", proxy.port))
                .await
                .unwrap();
            tokio::task::yield_now().await;
            proxy.down();
            for stream in [&mut open, &mut frozen] {
                let mut rest = Vec::new();
                let closed =
                    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest))
                        .await;
                assert!(closed.is_ok(), "a connection stayed open after down()");
            }
        }
    }

    #[test]
    fn the_proxy_forwards_to_the_broker_amqp_url_names() {
        let url = url::Url::parse(&amqp_url()).unwrap();
        assert!(broker_address().ends_with(&format!(":{}", url.port().unwrap_or(5672))));
    }
}
