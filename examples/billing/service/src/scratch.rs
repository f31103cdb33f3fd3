//! Throwaway runs (`billing demo`, `billing chaos`): a database of their own,
//! and what they leave behind removed afterwards.

use warren_admin::DatabaseUrl;

use crate::config::Config;
use crate::db::{self, Database};
use crate::service::{self, Names, Settings};

/// A database with nothing in it: a temporary SQLite file, a schema of its own
/// on PostgreSQL, or a database of its own on MySQL.
pub struct Fresh {
    /// The database, open.
    pub db: Database,
    /// A URL other processes can open the same database with.
    pub url: String,
    /// The PostgreSQL schema or MySQL database made for this run.
    pub schema: Option<String>,
    /// A temporary directory of this run's own (the SQLite file is in it).
    pub temp: std::path::PathBuf,
}

/// A fresh database like `cli`'s: a new schema or database on its server, or
/// a SQLite file in a new temporary directory. It says which on standard
/// output: the demo's and the chaos run's reports begin with it.
#[allow(clippy::print_stdout)]
pub async fn fresh_database(cli: &Config, tag: &str, pool: u32) -> Result<Fresh, String> {
    let temp = tempdir()?;
    match &cli.database_url {
        None => {
            let path = temp.join("billing.db");
            let url = format!("sqlite://{}", path.display());
            println!("database: SQLite {}", path.display());
            let db = db::open(&DatabaseUrl::Sqlite(url.clone()), None, pool).await?;
            Ok(Fresh {
                db,
                url,
                schema: None,
                temp,
            })
        }
        Some(url @ DatabaseUrl::Postgres(u)) => {
            let schema = format!("billing_{tag}");
            create_schema(url, &schema).await?;
            println!("database: PostgreSQL {} (schema {schema})", url.redacted());
            let db = db::open(url, Some(&schema), pool).await?;
            let sep = if u.contains('?') { '&' } else { '?' };
            let child = format!("{u}{sep}options=-c%20search_path%3D{schema}");
            Ok(Fresh {
                db,
                url: child,
                schema: Some(schema),
                temp,
            })
        }
        Some(url @ DatabaseUrl::MySql(u)) => {
            let name = format!("billing_{tag}");
            let child = db::mysql::with_database(u, &name);
            let options = warren::MySqlStore::options(&child).map_err(|e| e.to_string())?;
            db::mysql::create_database(&options, &name)
                .await
                .map_err(|e| format!("cannot create database {name}: {e}"))?;
            println!("database: MySQL {} (database {name})", url.redacted());
            let db = db::open(&DatabaseUrl::MySql(child.clone()), None, pool).await?;
            Ok(Fresh {
                db,
                url: child,
                schema: Some(name),
                temp,
            })
        }
        Some(url) => {
            println!("database: {}", url.redacted());
            let db = db::open(url, None, pool).await?;
            Ok(Fresh {
                db,
                url: url.as_str().to_owned(),
                schema: None,
                temp,
            })
        }
    }
}

/// A new temporary directory of the run's own.
pub fn tempdir() -> Result<std::path::PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("billing-demo-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// Creates `schema` on the PostgreSQL server at `url`.
pub async fn create_schema(url: &DatabaseUrl, schema: &str) -> Result<(), String> {
    let options = warren::PgStore::options(url.as_str()).map_err(|e| e.to_string())?;
    let pool = sqlx::PgPool::connect_with(options)
        .await
        .map_err(|e| format!("cannot open {}: {e}", url.redacted()))?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&pool)
        .await
        .map_err(|e| format!("cannot create schema {schema}: {e}"))?;
    pool.close().await;
    Ok(())
}

/// Drops `schema` and everything in it, if the server answers.
pub async fn drop_schema(url: &DatabaseUrl, schema: &str) {
    if let Ok(options) = warren::PgStore::options(url.as_str())
        && let Ok(pool) = sqlx::PgPool::connect_with(options).await
    {
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&pool)
            .await;
        pool.close().await;
    }
}

/// Removes what a throwaway run created: its queues and exchanges, and its
/// schema or database.
pub async fn teardown(cli: &Config, names: &Names, settings: &Settings, schema: Option<&str>) {
    if let Ok(connection) =
        warren::broker::connect_with_tls(&cli.amqp_url, "billing demo teardown", &cli.tls).await
    {
        if let Ok(topology) = service::topology(names, settings) {
            let _ = warren::broker::delete(&connection, &topology).await;
        }
        if let Ok(topology) = service::credit_topology(names, settings) {
            let _ = warren::broker::delete(&connection, &topology).await;
        }
        let _ = connection.close(200, "done".into()).await;
    }
    if let (Some(name), Some(DatabaseUrl::MySql(url))) = (schema, &cli.database_url) {
        let _ = db::mysql::drop_database(url, name).await;
        return;
    }
    if let (Some(schema), Some(url)) = (schema, &cli.database_url) {
        drop_schema(url, schema).await;
    }
}
