//! The console beside `billing run`, in a real browser (Debian's chromium,
//! headless, through chromedriver), on PostgreSQL: one customer's payments
//! fail for a missing configuration row and are dead-lettered as one group;
//! an operator logs in, finds the group, fixes the row and replays the group
//! carefully from the page; every payment is then applied once and the group
//! is gone. Also: a `<script>` payload renders as text, the page fits 1280 x
//! 800, the audit names the operator, and a form from another origin is
//! refused. Each step leaves a screenshot in `target/screenshots/console/`.

mod common;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use warren::Outgoing;
use warren::broker::Publisher;

use common::*;

const ALICE: &str = "alice-token-0123456789";

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
    let port = free_port();
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
        json!({
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
            Err(_) if Instant::now() < deadline => {
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

async fn click(client: &Client, what: Locator<'_>) {
    client.find(what).await.unwrap().click().await.unwrap();
}

/// The page is as wide as the window or narrower: nothing to scroll sideways.
async fn fits_the_window(client: &Client, page: &str) {
    let widths = client
        .execute(
            "return [document.documentElement.scrollWidth, window.innerWidth]",
            vec![],
        )
        .await
        .unwrap();
    let (scroll, window) = (widths[0].as_i64().unwrap(), widths[1].as_i64().unwrap());
    assert_eq!(window, 1280, "the window is 1280 wide");
    assert!(
        scroll <= window,
        "{page}: {scroll} px wide in a {window} px window"
    );
}

/// One `billing.invoice-paid.v1`; its message id.
async fn pay(publisher: &Publisher, prefix: &str, invoice: &str, customer: &str) -> String {
    let message = Outgoing::new(
        "billing.invoice-paid.v1",
        1,
        &json!({"invoiceId": invoice, "customerId": customer, "amount": "120.50", "currency": "EUR"}),
    )
    .unwrap();
    publisher
        .publish(
            &format!("{prefix}.events"),
            "billing.invoice-paid.v1",
            &message,
        )
        .await
        .unwrap();
    message.meta().message_id.clone()
}

async fn count(pool: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_fixes_a_customers_failed_payments_in_the_browser() {
    let schema = PgSchema::create("billing_console").await;
    let prefix = unique("billing-console");
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("alice {ALICE}\n")).unwrap();
    let port = free_port();
    let console_port = free_port();
    let common = [
        "--prefix",
        prefix.as_str(),
        "--database-url",
        schema.url.as_str(),
        "--retry-tiers",
        "200ms",
    ];
    let mut run = start_run(
        billing().args(common).args([
            "--console",
            &format!("127.0.0.1:{console_port}"),
            "--console-tokens",
            tokens.to_str().unwrap(),
        ]),
        port,
    )
    .await;

    // The cause: loyalty credit needs a configured account, and customer
    // cus_acme has none. Every one of its payments fails the same way, on
    // every attempt, until the row is there.
    let db = sqlx::PgPool::connect(&schema.url).await.unwrap();
    for statement in [
        "CREATE TABLE loyalty_accounts (customer_id TEXT PRIMARY KEY)",
        "INSERT INTO loyalty_accounts VALUES ('cus_globex')",
        "CREATE FUNCTION loyalty_account_required() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NOT EXISTS (SELECT 1 FROM loyalty_accounts WHERE customer_id = NEW.customer_id) THEN
             RAISE EXCEPTION 'no loyalty account is configured for customer %', NEW.customer_id;
           END IF;
           RETURN NEW;
         END $$",
        "CREATE TRIGGER loyalty_account_required BEFORE INSERT ON loyalty_points
         FOR EACH ROW EXECUTE FUNCTION loyalty_account_required()",
    ] {
        sqlx::query(statement).execute(&db).await.unwrap();
    }

    let connection = Arc::new(warren_connect().await);
    let publisher = Publisher::new(Arc::clone(&connection));
    let mut acme = Vec::new();
    for n in 0..3 {
        acme.push(pay(&publisher, &prefix, &format!("inv_acme_{n}"), "cus_acme").await);
    }
    for n in 0..2 {
        pay(
            &publisher,
            &prefix,
            &format!("inv_globex_{n}"),
            "cus_globex",
        )
        .await;
    }
    // Hostile input: refused by billing's rules, so dead-lettered, with a
    // script where an id should be.
    let hostile = pay(
        &publisher,
        &prefix,
        "<script>alert('payload')</script>",
        "cus_globex",
    )
    .await;

    let status_now = || async { output(billing().args(common).arg("status")).await.1 };
    let settled = wait_for(Duration::from_secs(60), || async {
        let status = status_now().await;
        line_value(&status, "dead letters unresolved") == Some(4)
            && line_value(&status, "invoices paid") == Some(2)
    })
    .await;
    assert!(settled, "{}", status_now().await);

    let base = format!("http://127.0.0.1:{console_port}");
    let (_driver, client) = browser().await;

    // 1. Nothing without a login: the page sends to the login form.
    client.goto(&format!("{base}/")).await.unwrap();
    assert_eq!(client.current_url().await.unwrap().path(), "/login");
    shot(&client, "01-login").await;
    client
        .find(Locator::Css("input[name=token]"))
        .await
        .unwrap()
        .send_keys(ALICE)
        .await
        .unwrap();
    click(&client, Locator::Css("form button")).await;
    client
        .wait()
        .for_element(Locator::Css("table.groups"))
        .await
        .unwrap();

    // 2. The customer's group first, with its count and the cause.
    assert_eq!(text_of(&client, "#unresolved").await, "4");
    assert_eq!(
        text_of(&client, "table.groups tbody tr td.count").await,
        "3",
        "the largest group first"
    );
    let first_error = text_of(&client, "table.groups tbody tr td.error-text").await;
    assert!(
        first_error.contains("no loyalty account is configured for customer cus_acme"),
        "{first_error}"
    );
    let group = client
        .find(Locator::Css("table.groups tbody tr a.group"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    fits_the_window(&client, "the groups page").await;
    shot(&client, "02-groups").await;

    // 3. The hostile letter, found by its message id: its payload is text,
    // and the only script on the page is the console's own.
    client
        .goto(&format!("{base}/letters?message_id={hostile}"))
        .await
        .unwrap();
    click(&client, Locator::Css("table td a")).await;
    client
        .wait()
        .for_element(Locator::Css("pre.payload"))
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
    assert_eq!(scripts, json!(1), "only the console's script");
    fits_the_window(&client, "a letter's page").await;
    shot(&client, "03-hostile-letter-as-text").await;
    let hostile_letter = client.current_url().await.unwrap();

    // 4. Fix the cause, then replay the group carefully from its row.
    sqlx::query("INSERT INTO loyalty_accounts VALUES ('cus_acme')")
        .execute(&db)
        .await
        .unwrap();
    client.goto(&format!("{base}/")).await.unwrap();
    let replay = format!(
        "//form[input[@name='action' and @value='replay-group'] and input[@name='group' and @value='{group}']]//button"
    );
    click(&client, Locator::XPath(&replay)).await;
    let confirm = client
        .wait()
        .for_element(Locator::Css("#confirm"))
        .await
        .expect("a confirmation page");
    assert_eq!(
        line_value(&status_now().await, "dead letters unresolved"),
        Some(4),
        "nothing replayed before the confirmation"
    );
    shot(&client, "04-confirm").await;
    confirm.click().await.unwrap();
    client
        .wait()
        .for_element(Locator::Css("#state"))
        .await
        .expect("the run's page");
    // The page's own script follows the run until it finishes.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = text_of(&client, "#state").await;
        if state == "finished" {
            break;
        }
        assert!(
            state == "running" && Instant::now() < deadline,
            "the run did not finish: {state}: {}",
            text_of(&client, "#stop-reason").await
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(text_of(&client, "#published").await, "3");
    shot(&client, "05-run-finished").await;

    // 5. Every payment applied once: each invoice paid, one loyalty credit
    // per message, one event out per payment; only the hostile letter left.
    let applied = wait_for(Duration::from_secs(60), || async {
        let status = status_now().await;
        line_value(&status, "invoices paid") == Some(5)
            && line_value(&status, "outbox pending") == Some(0)
            && line_value(&status, "dead letters unresolved") == Some(1)
    })
    .await;
    let status = status_now().await;
    assert!(applied, "{status}");
    assert_eq!(line_value(&status, "loyalty rows"), Some(5), "{status}");
    assert_eq!(line_value(&status, "outbox published"), Some(5), "{status}");
    for id in &acme {
        assert_eq!(
            count(
                &db,
                &format!("SELECT count(*) FROM loyalty_points WHERE message_id = '{id}'")
            )
            .await,
            1,
            "{id} credited once"
        );
    }
    client.goto(&format!("{base}/")).await.unwrap();
    let page = client.source().await.unwrap();
    assert!(!page.contains(&group), "the group is gone: {page}");
    assert_eq!(text_of(&client, "#unresolved").await, "1");
    shot(&client, "06-group-resolved").await;

    // 6. The audit names the operator who replayed.
    client.goto(&format!("{base}/audit")).await.unwrap();
    let audit = client.source().await.unwrap();
    assert!(
        audit.contains("alice") && audit.contains("replay"),
        "the audit names alice's replay: {audit}"
    );
    shot(&client, "07-audit").await;

    // 7. Another origin's form is refused, whatever it asks.
    let letter_id = hostile_letter.path().rsplit('/').next().unwrap().to_owned();
    let forged = format!(
        "data:text/html,<form method=post action='{base}/act'><input name=action value=resolve-letter>\
         <input name=letter value='{letter_id}'><input name=confirmed value=yes><button id=go>go</button></form>"
    );
    client.goto(&forged).await.unwrap();
    click(&client, Locator::Css("#go")).await;
    assert!(
        wait_for(Duration::from_secs(10), || async {
            let body = client.source().await.unwrap_or_default();
            body.contains("log in first") || body.contains("refused")
        })
        .await,
        "a form from another origin was not refused: {}",
        client.source().await.unwrap_or_default()
    );
    shot(&client, "08-forged-form-refused").await;
    assert_eq!(
        line_value(&status_now().await, "dead letters unresolved"),
        Some(1),
        "the forged form resolved nothing"
    );

    client.close().await.unwrap();
    let pid = run.id().unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = tokio::time::timeout(Duration::from_secs(60), run.wait()).await;
    db.close().await;
    delete_prefix(&connection, &prefix).await;
    schema.remove().await;
}
