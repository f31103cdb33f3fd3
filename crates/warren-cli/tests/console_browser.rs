//! The console in a real browser (Debian's chromium, headless, through
//! chromedriver): log in, find the failed group, fix the cause, replay it
//! carefully and watch the run finish on its page, see the group gone; a
//! `<script>` payload renders as text, and another origin's form is refused.
//! Each step leaves a screenshot in `target/screenshots/console/`.

use std::process::Stdio;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use warren::Consumer;
use warren::store::DeadLetterStore;

use crate::console::{ALICE, Staged, encode, staged, start_console};
use crate::util::{Backend, Running, TestBroker, routes, wait_for};

/// Where the screenshots go: a known path under the workspace's target.
fn screenshot_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/screenshots/console")
}

/// chromedriver on a free port, and a headless chromium session on it.
async fn browser() -> (tokio::process::Child, Client) {
    // Already installed by an earlier test is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect(
            "chromedriver is not installed: apt-get install chromium chromium-driver (.ci/run does)",
        );
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child = tokio::process::Command::new(driver)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("chromedriver starts");
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": "/usr/bin/chromium",
            // Run as root in CI, chromium needs --no-sandbox.
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,800"],
        }),
    );
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match ClientBuilder::rustls()
            .unwrap()
            .capabilities(caps.clone())
            .connect(&url)
            .await
        {
            Ok(client) => return (child, client),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no browser session: {e}"),
        }
    }
}

async fn shot(client: &Client, name: &str) {
    let png = client.screenshot().await.unwrap();
    let dir = screenshot_dir();
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("{name}.png")), png).unwrap();
}

async fn text_of(client: &Client, css: &str) -> String {
    client
        .find(Locator::Css(css))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_fixes_a_failed_group_in_the_browser() {
    let db = <sqlx::Postgres as Backend>::create().await;
    let broker = TestBroker::new().await;
    // A group that shares one cause: the handler is broken until mended,
    // as a missing configuration row would break it.
    let Staged {
        failed,
        group,
        hostile,
        tokens,
        dir: _dir,
        ..
    } = staged(&db, &broker).await;
    let hostile = hostile.letter_id;
    let store = db.store.clone();
    let console = start_console(&db.url, &tokens).await;
    let base = format!("http://{}", console.addr);
    let (_driver, client) = browser().await;

    // 1. Log in with the operator's token.
    client.goto(&format!("{base}/")).await.unwrap();
    assert!(client.current_url().await.unwrap().path() == "/login");
    shot(&client, "01-login").await;
    let field = client
        .find(Locator::Css("input[name=token]"))
        .await
        .unwrap();
    field.send_keys(ALICE).await.unwrap();
    client
        .find(Locator::Css("form button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    client
        .wait()
        .for_element(Locator::Css("table.groups"))
        .await
        .unwrap();

    // 2. The group is there, the worst first, with its count.
    let first_count = text_of(&client, "table.groups tbody tr td.count").await;
    assert_eq!(first_count, "3", "the largest group first");
    let page = client.source().await.unwrap();
    assert!(page.contains(&group), "the group is listed");
    shot(&client, "02-groups").await;

    // 3. A <script> payload renders as text and runs nothing: the only script
    // on the page is the console's own.
    client
        .goto(&format!("{base}/letters/{}", encode(&hostile)))
        .await
        .unwrap();
    let shown = text_of(&client, "pre.payload").await;
    assert!(
        shown.contains("<script>alert('payload')</script>"),
        "as text: {shown}"
    );
    let scripts = client
        .execute("return document.querySelectorAll('script').length", vec![])
        .await
        .unwrap();
    assert_eq!(scripts, serde_json::json!(1), "only the console's script");
    let images = client
        .execute("return document.querySelectorAll('img').length", vec![])
        .await
        .unwrap();
    assert_eq!(
        images,
        serde_json::json!(0),
        "no attribute broke out into an <img>"
    );
    shot(&client, "03-hostile-letter-as-text").await;

    // 4. The cause is fixed (dead_letter_some mends the handler once its
    // messages are dead-lettered); replay the group carefully from its row.
    let running = Running::start(Consumer::new(
        broker.config(),
        db.store.clone(),
        routes::<sqlx::Postgres>(),
    ));
    client.goto(&format!("{base}/")).await.unwrap();
    let replay = format!(
        "//form[input[@name='action' and @value='replay-group'] and input[@name='group' and @value='{group}']]//button"
    );
    client
        .find(Locator::XPath(&replay))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let Ok(confirm) = client.wait().for_element(Locator::Css("#confirm")).await else {
        shot(&client, "04-no-confirm").await;
        panic!(
            "no confirmation page: {}",
            client.source().await.unwrap_or_default()
        );
    };
    shot(&client, "04-confirm").await;
    confirm.click().await.unwrap();
    if client
        .wait()
        .for_element(Locator::Css("#state"))
        .await
        .is_err()
    {
        panic!(
            "no run page after confirming: {}",
            client.source().await.unwrap_or_default()
        );
    }
    // The page's own script follows the run until it finishes.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = text_of(&client, "#state").await;
        if state == "finished" {
            break;
        }
        assert!(Instant::now() < deadline, "the run did not finish: {state}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(text_of(&client, "#published").await, "3");
    shot(&client, "05-run-finished").await;
    assert!(running.settled(3, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    for id in &failed {
        assert_eq!(db.effects_for(id).await, 1, "{id} applied once");
    }

    // 5. The group shows as dealt with: no longer among the unresolved.
    client.goto(&format!("{base}/")).await.unwrap();
    let page = client.source().await.unwrap();
    assert!(
        !page.contains(&group),
        "the group is gone from the unresolved"
    );
    shot(&client, "06-group-resolved").await;
    let audit = store.audit_log(20).await.unwrap();
    assert!(
        audit
            .iter()
            .any(|e| e.operator == "alice" && e.action == "replay"),
        "the audit names the operator who replayed: {audit:?}"
    );

    // 6. Another origin's form is refused, whatever it asks.
    let forged = format!(
        "data:text/html,<form method=post action='{base}/act'><input name=action value=resolve-letter>\
         <input name=letter value='{hostile}'><input name=confirmed value=yes><button id=go>go</button></form>"
    );
    client.goto(&forged).await.unwrap();
    client
        .find(Locator::Css("#go"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || async {
            let body = client.source().await.unwrap_or_default();
            body.contains("log in first") || body.contains("refused")
        })
        .await,
        "a form from another origin was not refused: {}",
        client.source().await.unwrap_or_default()
    );
    shot(&client, "07-forged-form-refused").await;
    let state = store
        .dead_letter(&hostile)
        .await
        .unwrap()
        .unwrap()
        .letter
        .state;
    assert_eq!(
        state,
        warren::store::LetterState::Unresolved,
        "the forged form changed nothing"
    );

    client.close().await.unwrap();
    drop(console);
    broker.cleanup().await;
    db.drop_db().await;
}
