//! Putting the guard under lapin. lapin takes its byte stream from a connect
//! function whose stream type is fixed by the runtime it runs on
//! (`Connection::connector`), so warren runs lapin on a runtime of its own: the
//! tokio one in every respect, but for a stream type that is the guard around
//! the plain or TLS stream.

use std::future::Future;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use async_rs::traits::{Executor, Reactor, RuntimeKit};
use async_rs::util::Task;
use async_rs::{Runtime, Tokio};
use futures_util::Stream;
use lapin::tcp::{AMQPUriTcpExt, AsyncTcpStream, OwnedTLSConfig};
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties};

use super::frames::FrameGuard;

/// The stream lapin reads: the guard around the socket, or around TLS.
type Guarded = FrameGuard<AsyncTcpStream<<Tokio as Reactor>::TcpStream>>;

/// tokio, with the guarded stream as its TCP stream.
#[derive(Debug, Clone)]
pub(crate) struct GuardedTokio(Tokio);

impl Executor for GuardedTokio {
    type Task<T: Send + 'static> = <Tokio as Executor>::Task<T>;

    fn block_on<T, F: Future<Output = T>>(&self, f: F) -> T {
        self.0.block_on(f)
    }

    fn spawn<T: Send + 'static, F: Future<Output = T> + Send + 'static>(
        &self,
        f: F,
    ) -> Task<Self::Task<T>> {
        self.0.spawn(f)
    }

    fn spawn_blocking<T: Send + 'static, F: FnOnce() -> T + Send + 'static>(
        &self,
        f: F,
    ) -> Task<Self::Task<T>> {
        self.0.spawn_blocking(f)
    }
}

impl Reactor for GuardedTokio {
    type TcpStream = Guarded;
    type Sleep = <Tokio as Reactor>::Sleep;

    /// lapin never registers a raw handle; a guard cannot be put around one
    /// it has not framed, so this refuses.
    fn register<H: Read + Write + Send + 'static>(
        &self,
        _socket: H,
    ) -> io::Result<impl futures_io::AsyncRead + futures_io::AsyncWrite + Send + Unpin + 'static>
    {
        Err::<Guarded, _>(io::Error::new(
            io::ErrorKind::Unsupported,
            "warren's AMQP runtime takes only guarded TCP streams",
        ))
    }

    fn sleep(&self, dur: Duration) -> Self::Sleep {
        self.0.sleep(dur)
    }

    fn interval(&self, dur: Duration) -> impl Stream<Item = Instant> + Send + 'static {
        self.0.interval(dur)
    }

    fn tcp_connect_addr(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = io::Result<Self::TcpStream>> + Send + 'static {
        let connecting = self.0.tcp_connect_addr(addr);
        async move { Ok(FrameGuard::new(AsyncTcpStream::Plain(connecting.await?), 0)) }
    }
}

impl RuntimeKit for GuardedTokio {}

/// Opens a lapin connection to `uri` whose every inbound byte passes the
/// guard. Same handshake, TLS and reconnect behaviour as lapin's own
/// `Connection::connect_with_config` on tokio.
pub(crate) async fn connect(
    uri: AMQPUri,
    properties: ConnectionProperties,
    tls: OwnedTLSConfig,
) -> lapin::Result<Connection> {
    let tokio = Runtime::new(Tokio::current());
    let runtime = Runtime::new(GuardedTokio(Tokio::current()));
    Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, _runtime: Runtime<GuardedTokio>| {
            let stream = uri
                .connect_with_config_async(tls.as_ref(), &tokio)
                .await
                .map_err(lapin::Error::from)?;
            let client_frame_max = uri.query.frame_max.unwrap_or_default();
            Ok(AsyncTcpStream::Plain(FrameGuard::new(
                stream,
                client_frame_max,
            )))
        },
        properties,
    )
    .await
}
