//! The console's own TLS: a certificate chain and key from PEM files, and a
//! listener that hands axum only connections whose handshake completed.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// The certificate the console presents and its private key, PEM files.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// A client that connects and never finishes its handshake gives up its slot
/// after this long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at once. A connection that finds them all taken
/// is closed at once: the accept loop never waits, so idle sockets cannot
/// hold it up.
const MAX_HANDSHAKES: usize = 256;

/// Handshakes in progress at once from one address, so that one client
/// cannot take every slot.
const MAX_HANDSHAKES_PER_PEER: usize = 16;

impl ServerTls {
    /// Reads both files and builds the server's TLS settings; an error names
    /// the file and what is wrong with it.
    pub(crate) fn load(&self) -> Result<Arc<ServerConfig>, String> {
        let certs = read_certs(&self.cert)?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| {
            format!(
                "the console's TLS key {}: {}",
                self.key.display(),
                pem_error(&e)
            )
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("the console's TLS settings: {e}"))?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map(|mut config| {
                // HTTP/1.1 is all the console speaks.
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                Arc::new(config)
            })
            .map_err(|e| {
                format!(
                    "the console's TLS key {} does not go with the certificate {}: {e}",
                    self.key.display(),
                    self.cert.display()
                )
            })
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| {
            format!(
                "the console's TLS certificate {}: {}",
                path.display(),
                pem_error(&e)
            )
        })?;
    if certs.is_empty() {
        return Err(format!(
            "the console's TLS certificate {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

fn pem_error(e: &rustls::pki_types::pem::Error) -> String {
    match e {
        rustls::pki_types::pem::Error::Io(io) => io.to_string(),
        rustls::pki_types::pem::Error::NoItemsFound => "no PEM item of that kind in it".into(),
        other => format!("not a PEM file ({other:?})"),
    }
}

/// Accepts TCP connections and completes their TLS handshakes off the accept
/// loop, so one slow client does not hold up the others.
pub(crate) struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    acceptor: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    pub(crate) fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(MAX_HANDSHAKES);
        let tls = TlsAcceptor::from(config);
        let slots = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let peers: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>> = Arc::default();
        let acceptor = tokio::spawn(async move {
            loop {
                let (stream, peer) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, most likely: wait, as axum's own
                        // accept loop does, rather than spin.
                        tracing::warn!(error = %e, "the console could not accept a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Some(peer_slot) = PeerSlot::take(&peers, peer.ip()) else {
                    tracing::debug!(%peer, "too many TLS handshakes from one address; closed");
                    continue;
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    tracing::warn!(%peer, "too many TLS handshakes at once; connection closed");
                    continue;
                };
                let tls = tls.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await;
                    drop((slot, peer_slot));
                    match handshake {
                        Ok(Ok(stream)) => {
                            let _ = tx.send((stream, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "a TLS handshake with the console failed");
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "a TLS handshake with the console timed out");
                        }
                    }
                });
            }
        });
        Ok(Self {
            ready,
            local,
            acceptor,
        })
    }
}

/// One of an address's handshake slots, given back when dropped.
struct PeerSlot {
    peers: Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl PeerSlot {
    fn take(peers: &Arc<std::sync::Mutex<HashMap<IpAddr, usize>>>, ip: IpAddr) -> Option<Self> {
        let mut map = peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = map.entry(ip).or_default();
        if *n >= MAX_HANDSHAKES_PER_PEER {
            return None;
        }
        *n += 1;
        Some(Self {
            peers: Arc::clone(peers),
            ip,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut map = self
            .peers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.acceptor.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The accept loop only ends when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
