//! What the console's tests share: HTTP requests on a plain or TLS stream,
//! `warren console` started on a free port, logins, and the staged letters
//! (a group that shares a cause, and a hostile letter) they start from.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use warren::lapin::BasicProperties;
use warren::store::{DeadLetterStore, LetterFilter, StoredDeadLetter};

use crate::cli::{dead_letter_some, ingest, warren_cmd};
use crate::util::{Backend, TestBroker, TestDb, wait_for};

pub(crate) const ALICE: &str = "alice-token-0123456789";
pub(crate) const BOB: &str = "bob-token-9876543210ab";

/// An HTTP answer.
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: HashMap<String, String>,
    pub(crate) body: String,
}

/// One HTTP/1.1 request on its own connection, read to the end.
pub(crate) async fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    http_on(stream, addr, method, path, headers, body).await
}

/// One HTTP/1.1 request on `stream` (plain or TLS) for host `addr`, read to
/// the end.
pub(crate) async fn http_on<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut stream: S,
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut request = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    if method == "POST" {
        request.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
        request.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("an HTTP answer");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let mut headers = HashMap::new();
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            headers
                .entry(k.trim().to_ascii_lowercase())
                .and_modify(|old: &mut String| {
                    old.push('\n');
                    old.push_str(v.trim());
                })
                .or_insert_with(|| v.trim().to_owned());
        }
    }
    let body = if headers.get("transfer-encoding").map(String::as_str) == Some("chunked") {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    Answer {
        status,
        headers,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// Form-encodes pairs.
pub(crate) fn form(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

/// Encodes a value for a URL.
pub(crate) fn encode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// The CSRF token a page's forms carry.
pub(crate) fn csrf_of(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a CSRF token");
    let rest = &page[at + "name=\"csrf\" value=\"".len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}

/// A running `warren console`, and the address it printed.
pub(crate) struct ConsoleProcess {
    _child: tokio::process::Child,
    pub(crate) addr: String,
}

/// `warren console` on a free loopback port with `tokens`, masking `card`.
pub(crate) async fn start_console(db_url: &str, tokens: &std::path::Path) -> ConsoleProcess {
    start_console_with(
        db_url,
        &["--tokens", tokens.to_str().unwrap(), "--mask", "card"],
        &[],
    )
    .await
}

/// `warren console` on a free loopback port with `args`, its environment
/// `env` added.
pub(crate) async fn start_console_with(
    db_url: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> ConsoleProcess {
    let mut command = warren_cmd();
    command.args(["console", "--database-url", db_url]);
    if !args.contains(&"--bind") {
        command.args(["--bind", "127.0.0.1:0"]);
    }
    let mut child = command
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn,warren_console=info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(url) = line.strip_prefix("warren: console on ") {
                let rest = url
                    .strip_prefix("http://")
                    .or_else(|| url.strip_prefix("https://"))
                    .expect("an http or https URL");
                return rest.trim_end_matches('/').to_owned();
            }
        }
        panic!("the console exited before it listened")
    })
    .await
    .expect("the console says where it listens");
    // Keep reading, so its logging never blocks on a full pipe.
    // Its log goes to the test's output, shown when a test fails.
    #[allow(clippy::print_stderr)]
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("console: {line}");
        }
    });
    ConsoleProcess {
        _child: child,
        addr,
    }
}

/// Waits up to a minute for the run at `run_page` to finish with
/// `published` letters out, as its progress feed says.
pub(crate) async fn run_finishes(
    addr: &str,
    run_page: &str,
    auth: &[(&str, &str)],
    published: u64,
) {
    let progress = format!("{run_page}/progress");
    assert!(
        wait_for(Duration::from_secs(60), || async {
            let a = http(addr, "GET", &progress, auth, "").await;
            let p: serde_json::Value = serde_json::from_str(&a.body).unwrap();
            p["state"] == "finished" && p["published"] == published
        })
        .await,
        "the run did not finish with {published} published: {}",
        http(addr, "GET", &progress, auth, "").await.body
    );
}

/// Logs in with `token`; the session cookie.
pub(crate) async fn login(addr: &str, token: &str) -> String {
    let a = http(addr, "POST", "/login", &[], &form(&[("token", token)])).await;
    assert_eq!(a.status, 303, "a login redirects: {}", a.body);
    let cookie = a.headers.get("set-cookie").expect("a session cookie");
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    cookie.split(';').next().unwrap().to_owned()
}

/// A letter no browser may run: script, attribute breakouts and a
/// `javascript:` link in the payload, the message id and the type.
pub(crate) async fn dead_letter_hostile(broker: &TestBroker) {
    let body = serde_json::json!({
        "note": "<script>alert('payload')</script>",
        "breakout": "\"><img src=x onerror=alert(1)>",
        "link": "javascript:alert(1)",
        "card": "4111111111111111",
    })
    .to_string();
    broker
        .publisher
        .publish_raw(
            "",
            &broker.dead_letter_queue(),
            body.as_bytes(),
            BasicProperties::default()
                .with_message_id("\"><script>alert('id')</script>".into())
                .with_type("<script>alert('type')</script>".into()),
        )
        .await
        .unwrap();
}

/// What the console tests start from: three letters of one group (a
/// handler broken until mended, which `dead_letter_some` mends once they are
/// dead-lettered) and one hostile letter, all stored; and a tokens file.
pub(crate) struct Staged {
    /// The message ids of the group's letters.
    pub(crate) failed: Vec<String>,
    /// Every stored letter.
    pub(crate) letters: Vec<StoredDeadLetter>,
    /// The group's key.
    pub(crate) group: String,
    /// The hostile letter.
    pub(crate) hostile: StoredDeadLetter,
    /// `alice` and `bob`, with their tokens.
    pub(crate) tokens: std::path::PathBuf,
    /// Holds the tokens file: gone when dropped.
    pub(crate) dir: tempfile::TempDir,
}

pub(crate) async fn staged<B: Backend>(db: &TestDb<B>, broker: &TestBroker) -> Staged {
    broker.declare().await;
    broker.track_queue(&warren_admin::unstored_queue_name(&broker.queue));
    let failed = dead_letter_some(db, broker, 3).await;
    dead_letter_hostile(broker).await;
    ingest(db, broker, 4).await;
    let letters = db
        .store
        .dead_letters(&LetterFilter::default(), None, 100)
        .await
        .unwrap();
    let group = letters
        .iter()
        .find(|l| failed.contains(&l.message_id))
        .expect("the group's letters stored")
        .group_key
        .clone();
    let hostile = letters
        .iter()
        .find(|l| l.message_id.contains("<script>"))
        .expect("the hostile letter stored")
        .clone();
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("# on call\nalice {ALICE}\nbob {BOB}\n")).unwrap();
    Staged {
        failed,
        letters,
        group,
        hostile,
        tokens,
        dir,
    }
}
