//! The console serving HTTPS itself, off loopback: only a client that
//! trusts its certificate gets a page, plain HTTP gets none, logins still
//! guard every page, the session cookie is `Secure`, and bad certificate
//! settings stop it at start saying which file is wrong.
//!
//! It uses the throwaway certificates of `.ci/tls-setup` (`WARREN_TLS_DIR`);
//! without them it prints a note and passes, as the broker's TLS tests do.

use std::path::Path;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

use crate::console_support::{ALICE, Answer, form, http_on, start_console_with};
use crate::util::{Backend, tls_dir};

/// A TLS client that trusts only `ca`.
fn trusting(ca: &Path) -> TlsConnector {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// One HTTPS request to `port` on loopback, the certificate checked for
/// `localhost`.
async fn https(
    tls: &TlsConnector,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Answer, std::io::Error> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let stream = tls
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await?;
    let host = format!("localhost:{port}");
    Ok(http_on(stream, &host, method, path, headers, body).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_loopback_the_console_serves_https_itself() {
    let Some(certs) = tls_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("alice {ALICE}\n")).unwrap();
    let db = <sqlx::Sqlite as Backend>::create().await;
    let db_url = db.url.clone();
    let cert = certs.join("server.pem");
    let key = certs.join("server.key");
    let console = start_console_with(
        &db_url,
        &[
            "--bind",
            "0.0.0.0:0",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
        ],
        &[],
    )
    .await;
    let port: u16 = console.addr.rsplit(':').next().unwrap().parse().unwrap();
    let tls = trusting(&certs.join("ca.pem"));

    // Reads need a login, over TLS as anywhere off loopback.
    let anonymous = https(&tls, port, "GET", "/", &[], "").await.unwrap();
    assert_eq!(anonymous.status, 303, "{}", anonymous.body);
    assert_eq!(
        anonymous.headers.get("location").map(String::as_str),
        Some("/login")
    );
    let bearer = format!("Bearer {ALICE}");
    let page = https(&tls, port, "GET", "/", &[("Authorization", &bearer)], "")
        .await
        .unwrap();
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.body.contains("unresolved"), "{}", page.body);

    // The session cookie is only ever sent back over TLS.
    let login = https(
        &tls,
        port,
        "POST",
        "/login",
        &[],
        &form(&[("token", ALICE)]),
    )
    .await
    .unwrap();
    assert_eq!(login.status, 303, "{}", login.body);
    let cookie = login.headers.get("set-cookie").expect("a session cookie");
    assert!(
        cookie.contains("Secure") && cookie.contains("HttpOnly"),
        "{cookie}"
    );

    // A client that trusts another CA does not get past the handshake.
    let stranger = trusting(&certs.join("other-ca.pem"));
    let refused = https(&stranger, port, "GET", "/", &[], "").await;
    assert!(
        refused.is_err(),
        "a certificate from the wrong CA was accepted"
    );

    // Plain HTTP on the same port gets no page: the handshake fails first.
    let mut plain = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    plain
        .write_all(format!("GET / HTTP/1.1\r\nHost: localhost:{port}\r\nAuthorization: {bearer}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = plain.read_to_end(&mut answer).await;
    assert!(
        !String::from_utf8_lossy(&answer).contains("unresolved"),
        "a page went out in the clear"
    );

    // The console still answers after the failed handshakes.
    let again = https(&tls, port, "GET", "/", &[("Authorization", &bearer)], "")
        .await
        .unwrap();
    assert_eq!(again.status, 200);
    drop(console);
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_settings_stop_the_console_naming_the_file() {
    let Some(certs) = tls_dir() else { return };
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    let server = certs.join("server.pem");
    let other_key = certs.join("client.key");
    let missing = dir.path().join("missing.pem");
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    for (args, says) in [
        (
            vec!["--tls-cert".to_owned(), path(&server)],
            "--tls-key".to_owned(),
        ),
        (
            vec![
                "--tls-cert".to_owned(),
                path(&missing),
                "--tls-key".to_owned(),
                path(&certs.join("server.key")),
            ],
            path(&missing),
        ),
        (
            vec![
                "--tls-cert".to_owned(),
                path(&not_pem),
                "--tls-key".to_owned(),
                path(&certs.join("server.key")),
            ],
            path(&not_pem),
        ),
        (
            vec![
                "--tls-cert".to_owned(),
                path(&server),
                "--tls-key".to_owned(),
                path(&other_key),
            ],
            "does not go with".to_owned(),
        ),
    ] {
        let mut all = vec!["console", "--database-url", "sqlite://nowhere.db"];
        all.extend(args.iter().map(String::as_str));
        let out = crate::cli::warren(&all).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(&says), "{args:?}: {stderr}");
    }
}
